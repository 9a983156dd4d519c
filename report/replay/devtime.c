/*
 * devtime.c: memshim-replay --device, the timed backend and the calibration (devtime.h).
 *
 * Owns the wall-clock samples of every driver call a replay makes through the real backend and
 * the fitted cost table; never changes what the pool asks for (each call goes through as it is),
 * and prints only the JSON fields and text lines its callers place.
 */
#include "devtime.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "msh.h"

static double dt_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- --device: every device call timed (wall clock), so the cost table can be checked --------
 * The wrapper sits between the pool and the real backend; map (cuMemMap) and set_access
 * (cuMemSetAccess) are separate backend calls, timed each under its own kind. */

static void timing_add(struct dev_timing *tm, enum msh_drv_call k, double s)
{
    tm->k[k].calls++;
    if (tm->k[k].n == tm->k[k].cap) {
        if (tm->k[k].cap >= TIMING_MAX_SAMPLES) return; /* enough for a median */
        size_t nc = tm->k[k].cap ? tm->k[k].cap * 2 : 1024;
        double *nv = realloc(tm->k[k].v, nc * sizeof *nv);
        if (!nv) return;
        tm->k[k].v = nv;
        tm->k[k].cap = nc;
    }
    tm->k[k].v[tm->k[k].n++] = s;
}

#define TM_(d) ((struct dev_timing *)(d)->impl)
#define TIMED_(kind, call)                                                                          \
    do {                                                                                           \
        double t0_ = dt_now_s();                                                                      \
        int rc_ = (call);                                                                          \
        timing_add(TM_(d), kind, dt_now_s() - t0_);                                                   \
        return rc_;                                                                                \
    } while (0)
#define IN_(d) (TM_(d)->inner)
static int tm_mem_info(struct msh_device *d, size_t *f, size_t *t) { TIMED_(MSH_DRV_MEM_INFO, IN_(d)->ops->mem_info(IN_(d), f, t)); }
static int tm_gran(struct msh_device *d, size_t *g) { return IN_(d)->ops->granularity(IN_(d), g); }
static int tm_reserve(struct msh_device *d, size_t size, size_t align, uint64_t *va)
{
    TIMED_(MSH_DRV_RESERVE, IN_(d)->ops->reserve(IN_(d), size, align, va));
}
static int tm_unreserve(struct msh_device *d, uint64_t va, size_t size)
{
    TIMED_(MSH_DRV_UNRESERVE, IN_(d)->ops->unreserve(IN_(d), va, size));
}
static int tm_create(struct msh_device *d, size_t size, uint64_t *h)
{
    TIMED_(MSH_DRV_CREATE, IN_(d)->ops->create(IN_(d), size, h));
}
static int tm_release(struct msh_device *d, uint64_t h, size_t size)
{
    TIMED_(MSH_DRV_RELEASE, IN_(d)->ops->release(IN_(d), h, size));
}
static int tm_map(struct msh_device *d, uint64_t va, size_t size, uint64_t h)
{
    TIMED_(MSH_DRV_MAP, IN_(d)->ops->map(IN_(d), va, size, h));
}
static int tm_set_access(struct msh_device *d, uint64_t va, size_t size)
{
    TIMED_(MSH_DRV_SET_ACCESS, IN_(d)->ops->set_access(IN_(d), va, size));
}
static int tm_unmap(struct msh_device *d, uint64_t va, size_t size)
{
    TIMED_(MSH_DRV_UNMAP, IN_(d)->ops->unmap(IN_(d), va, size));
}
static int tm_event_create(struct msh_device *d, uint64_t *ev) { return IN_(d)->ops->event_create(IN_(d), ev); }
static int tm_event_record(struct msh_device *d, uint64_t ev, uint64_t stream)
{
    TIMED_(MSH_DRV_EVENT_RECORD, IN_(d)->ops->event_record(IN_(d), ev, stream));
}
static int tm_event_query(struct msh_device *d, uint64_t ev) { return IN_(d)->ops->event_query(IN_(d), ev); }
static int tm_event_release(struct msh_device *d, uint64_t ev) { return IN_(d)->ops->event_release(IN_(d), ev); }
static int tm_stream_wait(struct msh_device *d, uint64_t stream, uint64_t ev)
{
    TIMED_(MSH_DRV_STREAM_WAIT, IN_(d)->ops->stream_wait(IN_(d), stream, ev));
}
static int tm_synchronize(struct msh_device *d) { TIMED_(MSH_DRV_SYNCHRONIZE, IN_(d)->ops->synchronize(IN_(d))); }
/* --spill with --device: host memory and the copies, timed like the rest (absent: no spill) */
static int tm_host_create(struct msh_device *d, size_t size, uint64_t *h)
{
    if (!IN_(d)->ops->host_create) return ENOTSUP;
    TIMED_(MSH_DRV_HOST_CREATE, IN_(d)->ops->host_create(IN_(d), size, h));
}
static int tm_copy(struct msh_device *d, uint64_t dst, uint64_t src, size_t size)
{
    if (!IN_(d)->ops->copy) return ENOTSUP;
    TIMED_(MSH_DRV_COPY_H2D, IN_(d)->ops->copy(IN_(d), dst, src, size));
}
#undef TIMED_
#undef IN_
#undef TM_
const struct msh_device_ops timed_ops = {
    .name = "timed",
    .mem_info = tm_mem_info,
    .granularity = tm_gran,
    .reserve = tm_reserve,
    .unreserve = tm_unreserve,
    .create = tm_create,
    .release = tm_release,
    .map = tm_map,
    .set_access = tm_set_access,
    .unmap = tm_unmap,
    .event_create = tm_event_create,
    .event_record = tm_event_record,
    .event_query = tm_event_query,
    .event_release = tm_event_release,
    .stream_wait = tm_stream_wait,
    .synchronize = tm_synchronize,
    .host_create = tm_host_create,
    .copy = tm_copy,
};

struct dev_timing *dev_timing_now; /* --device: the current trace's timings, or NULL */

void timing_reset(struct dev_timing *tm)
{
    for (int k = 0; k < MSH_DRV_NKINDS; k++) {
        free(tm->k[k].v);
        tm->k[k].v = NULL;
        tm->k[k].n = tm->k[k].cap = 0;
        tm->k[k].calls = 0;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* quantile q of v[0..n) (sorts v) */
static double quantile(double *v, size_t n, double q)
{
    if (!n) return 0;
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

/* ,"driver_timing":{kind:{calls,median_s,p90_s,mean_s}} for the kinds the pool called */
void json_timing(struct dev_timing *tm)
{
    printf(",\"driver_timing\":{");
    bool first = true;
    for (int k = 0; k < MSH_DRV_NKINDS; k++) {
        if (!tm->k[k].calls) continue;
        double sum = 0;
        for (size_t i = 0; i < tm->k[k].n; i++) sum += tm->k[k].v[i];
        double mean = tm->k[k].n ? sum / (double)tm->k[k].n : 0;
        double p50 = quantile(tm->k[k].v, tm->k[k].n, 0.5), p90 = quantile(tm->k[k].v, tm->k[k].n, 0.9);
        printf("%s\"%s\":{\"calls\":%llu,\"median_s\":%.9f,\"p90_s\":%.9f,\"mean_s\":%.9f}", first ? "" : ",",
               msh_drv_call_names[k], (unsigned long long)tm->k[k].calls, p50, p90, mean);
        first = false;
    }
    printf("}");
}

void text_timing(struct dev_timing *tm)
{
    printf("    driver calls timed on this device (wall clock per call; map includes the access grant):\n");
    for (int k = 0; k < MSH_DRV_NKINDS; k++) {
        if (!tm->k[k].calls) continue;
        double p50 = quantile(tm->k[k].v, tm->k[k].n, 0.5), p90 = quantile(tm->k[k].v, tm->k[k].n, 0.9);
        printf("      %-13s %9llu calls  median %10.2f us  p90 %10.2f us\n", msh_drv_call_names[k],
               (unsigned long long)tm->k[k].calls, p50 * 1e6, p90 * 1e6);
    }
}

/* --device calibration: each VMM call on one handle of one page and of ten pages (PyTorch's 2 and
 * 20 MiB expandable pages when the granularity is 2 MiB), timed directly on the backend, and the
 * per-call/per-MiB split that fits the two medians; and one access grant over 8 one-page mappings,
 * which splits cuMemSetAccess's per-call time from its per-mapping time (drvcost.h). */

/* One cuMemSetAccess over `n` adjacent one-page mappings (each its own handle), timed. <0: failed. */
static double access_over(struct msh_device *d, size_t gran, int n)
{
    uint64_t va = 0, h[8] = {0};
    if (n > 8 || d->ops->reserve(d, gran * (size_t)n, gran, &va)) return -1;
    int made = 0;
    for (; made < n; made++) {
        if (d->ops->create(d, gran, &h[made])) break;
        if (d->ops->map(d, va + gran * (size_t)made, gran, h[made])) {
            d->ops->release(d, h[made], gran);
            break;
        }
    }
    double t = -1;
    if (made == n) {
        double t0 = dt_now_s();
        if (!d->ops->set_access(d, va, gran * (size_t)n)) t = dt_now_s() - t0;
    }
    for (int i = 0; i < made; i++) {
        d->ops->unmap(d, va + gran * (size_t)i, gran);
        d->ops->release(d, h[i], gran);
    }
    d->ops->unreserve(d, va, gran * (size_t)n);
    return t;
}

static double median_of(double *v, size_t n) { return quantile(v, n, 0.5); }

void calibrate(int ordinal, const struct msh_drvcost *base, struct calib *c)
{
    memset(c, 0, sizeof *c);
    c->fit = *base;
    struct msh_device d;
    if (msh_dev_cuda_init(&d, ordinal) || d.ops->granularity(&d, &c->gran) || !c->gran) return;
    static const enum msh_drv_call vmm[] = {MSH_DRV_RESERVE, MSH_DRV_CREATE, MSH_DRV_MAP, MSH_DRV_SET_ACCESS,
                                            MSH_DRV_UNMAP, MSH_DRV_RELEASE, MSH_DRV_UNRESERVE};
    double v[MSH_DRV_NKINDS][CALIB_REPS];
    for (int si = 0; si < 2; si++) {
        size_t size = c->gran * (si ? 10 : 1);
        for (int r = 0; r < CALIB_REPS; r++) {
            uint64_t va = 0, h = 0;
            double t0 = dt_now_s();
            if (d.ops->reserve(&d, size, c->gran, &va)) return;
            double t1 = dt_now_s();
            if (d.ops->create(&d, size, &h)) return;
            double t2 = dt_now_s();
            if (d.ops->map(&d, va, size, h)) return;
            double t3 = dt_now_s();
            if (d.ops->set_access(&d, va, size)) return;
            double t3a = dt_now_s();
            if (d.ops->unmap(&d, va, size)) return;
            double t4 = dt_now_s();
            if (d.ops->release(&d, h, size)) return;
            double t5 = dt_now_s();
            if (d.ops->unreserve(&d, va, size)) return;
            double t6 = dt_now_s();
            v[MSH_DRV_RESERVE][r] = t1 - t0;
            v[MSH_DRV_CREATE][r] = t2 - t1;
            v[MSH_DRV_MAP][r] = t3 - t2;
            v[MSH_DRV_SET_ACCESS][r] = t3a - t3;
            v[MSH_DRV_UNMAP][r] = t4 - t3a;
            v[MSH_DRV_RELEASE][r] = t5 - t4;
            v[MSH_DRV_UNRESERVE][r] = t6 - t5;
        }
        for (size_t i = 0; i < sizeof vmm / sizeof vmm[0]; i++) c->med[si][vmm[i]] = median_of(v[vmm[i]], CALIB_REPS);
    }
    for (int r = 0; r < CALIB_REPS; r++) {
        uint64_t ev = 0;
        if (d.ops->event_create(&d, &ev)) return;
        double t0 = dt_now_s();
        if (d.ops->synchronize(&d)) return;
        double t1 = dt_now_s();
        if (d.ops->event_record(&d, ev, 0)) return;
        double t2 = dt_now_s();
        int rc = d.ops->stream_wait(&d, 0, ev);
        double t3 = dt_now_s();
        d.ops->event_release(&d, ev);
        if (rc) return;
        v[MSH_DRV_SYNCHRONIZE][r] = t1 - t0;
        v[MSH_DRV_EVENT_RECORD][r] = t2 - t1;
        v[MSH_DRV_STREAM_WAIT][r] = t3 - t2;
    }
    static const enum msh_drv_call one[] = {MSH_DRV_SYNCHRONIZE, MSH_DRV_EVENT_RECORD, MSH_DRV_STREAM_WAIT};
    for (size_t i = 0; i < sizeof one / sizeof one[0]; i++) {
        c->med[0][one[i]] = c->med[1][one[i]] = median_of(v[one[i]], CALIB_REPS);
        c->fit.per_call_s[one[i]] = c->med[0][one[i]];
        c->fit.per_mib_s[one[i]] = 0;
        c->fit.per_mapping_s[one[i]] = 0;
    }
    for (int r = 0; r < CALIB_REPS; r++)
        if ((v[MSH_DRV_SET_ACCESS][r] = access_over(&d, c->gran, 8)) < 0) return;
    c->access8 = median_of(v[MSH_DRV_SET_ACCESS], CALIB_REPS);
    double small_mib = (double)c->gran / (double)MSH_MiB, big_mib = small_mib * 10;
    for (size_t i = 0; i < sizeof vmm / sizeof vmm[0]; i++) {
        enum msh_drv_call k = vmm[i];
        double per_mib = (c->med[1][k] - c->med[0][k]) / (big_mib - small_mib);
        if (per_mib < 0) per_mib = 0; /* noise: the bigger handle was not slower */
        double per_mapping = 0;
        if (k == MSH_DRV_SET_ACCESS) { /* 8 mappings against one, the bytes' share taken out */
            per_mapping = (c->access8 - c->med[0][k] - 7 * small_mib * per_mib) / 7;
            if (per_mapping < 0) per_mapping = 0;
        }
        double per_call = c->med[0][k] - per_mib * small_mib - per_mapping;
        c->fit.per_call_s[k] = per_call > 0 ? per_call : 0;
        c->fit.per_mib_s[k] = per_mib;
        c->fit.per_mapping_s[k] = per_mapping;
    }
    c->ok = true;
}

void json_calib(const struct calib *c)
{
    printf(",\"driver_calibration\":");
    if (!c->ok) {
        printf("null");
        return;
    }
    printf("{\"granularity\":%zu,\"sizes\":[%zu,%zu],\"repetitions\":%d,\"median_s\":{", c->gran, c->gran,
           c->gran * 10, CALIB_REPS);
    bool first = true;
    for (int k = 0; k < MSH_DRV_NKINDS; k++) {
        if (k == MSH_DRV_MALLOC || k == MSH_DRV_FREE) continue;
        printf("%s\"%s\":[%.9f,%.9f]", first ? "" : ",", msh_drv_call_names[k], c->med[0][k], c->med[1][k]);
        first = false;
    }
    printf("},\"set_access_8_mappings_s\":%.9f,\"fitted\":{", c->access8);
    for (int k = 0; k < MSH_DRV_NKINDS; k++)
        printf("%s\"%s\":{\"per_call_s\":%.9f,\"per_mib_s\":%.9f,\"per_mapping_s\":%.9f}", k ? "," : "",
               msh_drv_call_names[k], c->fit.per_call_s[k], c->fit.per_mib_s[k], c->fit.per_mapping_s[k]);
    printf("}}");
}
