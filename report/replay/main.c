/*
 * main.c: memshim-replay, which replays recorded allocation streams through the real pool.
 *
 * Input: PyTorch memory snapshots or memshim traces (trace.h). Each device trace replays on its
 * own pool over the simulated device (or, with --device, over the driver that is present), with
 * the block sizes, order and streams of the recording. It answers: how much physical memory does
 * this job need under memshim (--capacity auto searches the minimum), what did the pool do (maps,
 * unmaps, reclaims), and is the loop steady (--passes 2). It never modifies its inputs; an OOM
 * during replay is a result, malformed input an error (exit 2) with the reason.
 *
 * --policy torch|torch-expandable replays the same stream through the models of PyTorch's caching
 * allocator (policy.h, docs/models.md), seeded with the segments a snapshot recorded; --compare
 * puts the three side by side per device trace (minimum capacity, ratio to the live peak, OOMs
 * and fit at --capacity, which also takes device names such as A100-80GB).
 *
 * Every run also reports the driver calls made (the pool's, or those PyTorch's allocator would
 * make) and their modelled seconds under a cost table (policy/drvcost.h; --driver-costs FILE);
 * with --device each call is also timed on the driver present, so the table can be checked.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <strings.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device.h"
#include "devtime.h"
#include "msh.h"
#include "policy.h"
#include "pool.h"
#include "stepfig.h"
#include "trace.h"

struct opts {
    bool json, use_device, auto_cap;
    uint64_t capacity; /* 0 = unlimited */
    const char *capacity_name; /* the device named with --capacity, or NULL */
    uint64_t gran, small_max;
    bool defrag;
    int passes;
    enum msh_policy_kind policy;
    const char *torch_conf; /* --torch-conf, or NULL: the snapshot's recorded settings */
    bool compare, validate, torch_empty_start;
    struct msh_drvcost cost; /* the default table, or --driver-costs FILE */
    bool check; /* --check: msh_pool_check during every replay (docs/testing.md) */
    uint64_t max_handle; /* --max-handle: the pool's largest physical handle (0: the default, no cap);
                          * one page is the page model, one handle per page */
    bool no_learn;       /* --no-learn: best fit only, never the learned step (for comparisons) */
    bool no_front;       /* --no-front: the pool without its front end (for comparisons) */
    bool debug;          /* --debug: the pool's debug log (learned steps found, packed, dropped) on stderr */
    bool spill;          /* --spill host: cold pages to host memory past the capacity (docs/pool.md "Spill") */
    uint64_t spill_max;  /* --spill-max: host bytes spilled pages may take (0: no cap) */
    int link;            /* --link: MSH_LINK_PCIE5 or MSH_LINK_C2C (the copies' cost) */
};

/* Devices users plan for: memory as nvidia-smi reports it (MiB), less 512 MiB for the CUDA
 * context, cuBLAS/cuDNN workspaces and the like (docs/models.md). */
static const struct { const char *name; uint64_t total_mib; } devices[] = {
    {"A100-40GB", 40960}, {"A100-80GB", 81920}, {"H100-80GB", 81559}, {"H200-141GB", 143771},
    {"L4", 23034},        {"L40S", 46068},      {"A10G", 23028},      {"T4", 15360},
    {"V100-16GB", 16160}, {"V100-32GB", 32510}, {"RTX3090", 24576},   {"RTX4090", 24564},
    {"A6000", 49140},
};
#define DEVICE_RESERVE_MIB 512

static int device_capacity(const char *name, uint64_t *out, const char **canon)
{
    for (size_t i = 0; i < sizeof devices / sizeof devices[0]; i++)
        if (!strcasecmp(name, devices[i].name)) {
            *out = (devices[i].total_mib - DEVICE_RESERVE_MIB) * MSH_MiB;
            *canon = devices[i].name;
            return 0;
        }
    return ENOENT;
}

/* original block address -> pool address, open addressing with backward-shift deletion */
struct amap {
    struct { uint64_t k, v; } *t;
    size_t cap;
};

static size_t amap_slot(const struct amap *m, uint64_t k)
{
    return (size_t)((k * 0x9E3779B97F4A7C15ull) >> 17) & (m->cap - 1);
}

static int amap_init(struct amap *m, size_t n)
{
    m->cap = 1024;
    while (m->cap < n * 2 + 16) m->cap <<= 1;
    m->t = calloc(m->cap, sizeof *m->t);
    return m->t ? 0 : ENOMEM;
}

static uint64_t *amap_get(struct amap *m, uint64_t k, bool create)
{
    k += 1; /* 0 marks an empty slot; address 0 is legal in a trace */
    size_t i = amap_slot(m, k);
    while (m->t[i].k && m->t[i].k != k) i = (i + 1) & (m->cap - 1);
    if (!m->t[i].k) {
        if (!create) return NULL;
        m->t[i].k = k;
        m->t[i].v = 0;
    }
    return &m->t[i].v;
}

static void amap_del(struct amap *m, uint64_t k)
{
    k += 1;
    size_t i = amap_slot(m, k);
    while (m->t[i].k && m->t[i].k != k) i = (i + 1) & (m->cap - 1);
    if (!m->t[i].k) return;
    m->t[i].k = 0;
    for (size_t j = (i + 1) & (m->cap - 1); m->t[j].k; j = (j + 1) & (m->cap - 1)) {
        size_t want = amap_slot(m, m->t[j].k);
        /* move j back to i when its home slot is not in (i, j] cyclically */
        if ((j > i && (want <= i || want > j)) || (j < i && (want <= i && want > j))) {
            m->t[i] = m->t[j];
            m->t[j].k = 0;
            i = j;
        }
    }
}

struct run_result {
    uint64_t ooms, allocs, events;
    struct msh_pool_stats st;             /* after the last pass */
    struct msh_pool_stats st_pass1;       /* after the first pass */
    struct msh_pool_stats st_before_last; /* after the events of the pass before the last one */
    double wall;
};

/* ---- driver calls: modelled cost, JSON and text ----------------------------------------------- */
static void drv_sub(const uint64_t *a, const uint64_t *b, uint64_t *out)
{
    for (int k = 0; k < MSH_DRV_NKINDS; k++) out[k] = a[k] >= b[k] ? a[k] - b[k] : 0;
}

/* The three counters the cost table prices (drvcost.h), of a stats struct (pool or policy). */
#define DRV_(s) (s).drv_calls, (s).drv_bytes, (s).drv_maps
/* Those of the last pass: a's minus b's, into lc/lb/lm. */
#define DRV_LAST_(a, b)                                                                            \
    uint64_t lc[MSH_DRV_NKINDS], lb[MSH_DRV_NKINDS], lm[MSH_DRV_NKINDS];                           \
    drv_sub((a).drv_calls, (b).drv_calls, lc);                                                     \
    drv_sub((a).drv_bytes, (b).drv_bytes, lb);                                                     \
    drv_sub((a).drv_maps, (b).drv_maps, lm)

/* ,"<prefix>driver_calls":{every kind},"<prefix>driver_bytes":{...},"<prefix>driver_mappings":{...},
 * "<prefix>driver_seconds":s */
static void json_drv(const char *prefix, const uint64_t *calls, const uint64_t *bytes, const uint64_t *maps,
                     const struct msh_drvcost *c)
{
    printf(",\"%sdriver_calls\":{", prefix);
    for (int k = 0; k < MSH_DRV_NKINDS; k++)
        printf("%s\"%s\":%llu", k ? "," : "", msh_drv_call_names[k], (unsigned long long)calls[k]);
    printf("},\"%sdriver_bytes\":{", prefix);
    for (int k = 0; k < MSH_DRV_NKINDS; k++)
        printf("%s\"%s\":%llu", k ? "," : "", msh_drv_call_names[k], (unsigned long long)bytes[k]);
    printf("},\"%sdriver_mappings\":{", prefix);
    for (int k = 0; k < MSH_DRV_NKINDS; k++)
        printf("%s\"%s\":%llu", k ? "," : "", msh_drv_call_names[k], (unsigned long long)maps[k]);
    printf("},\"%sdriver_seconds\":%.6f", prefix, msh_drvcost_seconds(c, calls, bytes, maps));
}

/* "0.123 s (create 512, map 512, ...)": the kinds that were called */
static void text_drv(const uint64_t *calls, const uint64_t *bytes, const uint64_t *maps, const struct msh_drvcost *c)
{
    printf("%.3f s (", msh_drvcost_seconds(c, calls, bytes, maps));
    bool any = false;
    for (int k = 0; k < MSH_DRV_NKINDS; k++) {
        if (!calls[k]) continue;
        printf("%s%s %llu", any ? ", " : "", msh_drv_call_names[k], (unsigned long long)calls[k]);
        any = true;
    }
    printf("%s)", any ? "" : "no calls");
}

static uint64_t ceil_div(uint64_t a, uint64_t b)
{
    return a / b + (a % b != 0);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int replay_trace_runs(const struct msh_trace_set *set, const struct msh_trace *t, const struct opts *o);

/* --check: the pool's invariants (msh_pool_check) after every event while a replay has at most
 * CHECK_ALL_EVENTS events over all its passes, else after about CHECK_BUDGET evenly spread ones,
 * and at the end of every pass (`i` = t->n). A check costs O(blocks + pages mapped), so the budget
 * keeps a checked run within seconds per trace. Returns 0 or EFAULT after printing the violation. */
#define CHECK_ALL_EVENTS 3000
#define CHECK_BUDGET 1500
static int replay_check(struct msh_pool *pool, const struct msh_trace *t, uint64_t capacity, int passes, int pass,
                        size_t i)
{
    uint64_t total = (uint64_t)t->n * (uint64_t)passes;
    uint64_t every = total <= CHECK_ALL_EVENTS ? 1 : total / CHECK_BUDGET;
    if (i < t->n && ((uint64_t)pass * t->n + i) % every) return 0;
    char why[512];
    if (!msh_pool_check(pool, why, sizeof why)) return 0;
    fprintf(stderr, "memshim-replay: --check: pool invariant broken after %s %zu of pass %d (device %d, capacity "
            "%llu): %s\n", i < t->n ? "event" : "the last event,", i < t->n ? i : t->n, pass + 1, t->device,
            (unsigned long long)capacity, why);
    return EFAULT;
}

static int replay(const struct msh_trace *t, const struct opts *o, uint64_t capacity, int passes,
                  struct run_result *res)
{
    memset(res, 0, sizeof *res);
    struct msh_device real, dev;
    int rc = o->use_device ? msh_dev_cuda_init(&real, t->device) : msh_dev_sim_init(&real, 0, o->gran);
    if (rc) {
        fprintf(stderr, "memshim-replay: cannot open the %s device (error %d)\n",
                o->use_device ? "CUDA" : "simulated", rc);
        return rc;
    }
    dev = real;
    if (o->use_device && dev_timing_now) { /* every call the pool makes is timed on its way to the driver */
        dev_timing_now->inner = &real;
        dev_timing_now->outer = (struct msh_device){.ops = &timed_ops, .ordinal = real.ordinal, .impl = dev_timing_now};
        dev = dev_timing_now->outer;
    }
    struct msh_pool_params prm;
    msh_pool_params_default(&prm);
    prm.limit_bytes = capacity;
    prm.small_max = o->small_max;
    prm.defrag = o->defrag;
    prm.max_handle_bytes = o->max_handle;
    prm.no_learn = o->no_learn;
    prm.front = !o->no_front; /* as tensor mode's pool (shim/core.c) */
    if (o->spill) { /* host memory through VMM on the simulated device (as much as asked for) */
        if (!o->use_device) msh_dev_sim_host(&real, 0);
        prm.spill = true;
        prm.spill_max_bytes = o->spill_max;
    }
    /* the replay packs a learned step itself, at the step boundary where it found it, so that
     * every figure is the same from run to run (a job's pool packs on a thread of its own while
     * allocations go on: docs/pool.md) */
    prm.plan_sync = true;
    /* VA only needs to hold the line: a few times the live peak keeps page tables small. */
    uint64_t base = capacity ? capacity : t->peak_live_bytes;
    prm.va_bytes = base * 4 > 8 * MSH_GiB ? base * 4 : 8 * MSH_GiB;
    struct msh_pool *pool;
    rc = msh_pool_create(&dev, &prm, &pool);
    if (rc) {
        fprintf(stderr, "memshim-replay: cannot create the pool (error %d)\n", rc);
        if (!o->use_device) msh_dev_sim_fini(&real);
        return rc;
    }
    struct amap m;
    if (amap_init(&m, t->n)) {
        msh_pool_destroy(pool);
        if (!o->use_device) msh_dev_sim_fini(&real);
        return ENOMEM;
    }
    /* wall counts the time spent on the trace's own events only: not the stats scan after the
     * first pass, nor releasing the live set between passes. */
    double wall = 0;
    int broken = 0;
    /* --spill: each pass is one step of the job, whose recording begins with what was live when it
     * began (weights, optimizer state), allocated again at every pass: the step is marked at the
     * pass's first free, so that those are cold as they would be in the job (docs/replay.md) */
    bool mark_at_free = false;
    for (int pass = 0; pass < passes && !broken; pass++) {
        double t0 = now_s();
        for (size_t i = 0; i < t->n; i++) {
            /* the state after event i - 1 (after the whole pass below) */
            if (o->check && i && (broken = replay_check(pool, t, capacity, passes, pass, i - 1))) break;
            const struct msh_trace_event *e = &t->ev[i];
            /* Streams of a recording are only names here; on a real device they would be
             * handles of another process, so --device replays everything on the null stream. */
            uint64_t stream = o->use_device ? 0 : e->stream;
            if (e->op == MSH_OP_ALLOC) {
                res->events++;
                uint64_t *slot = amap_get(&m, e->addr, true);
                if (*slot) continue; /* duplicate alloc of a live block: the reader counted it */
                uint64_t a = 0;
                if (msh_pool_alloc(pool, e->size, stream, &a)) {
                    res->ooms++;
                    amap_del(&m, e->addr);
                    continue;
                }
                res->allocs++;
                *slot = a;
            } else {
                res->events++;
                uint64_t *slot = amap_get(&m, e->addr, false);
                if (!slot) continue; /* unknown or failed block */
                if (MSH_UNLIKELY(mark_at_free)) {
                    mark_at_free = false;
                    msh_pool_mark_step(pool);
                }
                msh_pool_free(pool, *slot, stream);
                amap_del(&m, e->addr);
            }
        }
        wall += now_s() - t0;
        if (o->check && !broken) broken = replay_check(pool, t, capacity, passes, pass, t->n);
        if (pass == 0) msh_pool_get_stats(pool, &res->st_pass1);
        if (pass + 2 == passes) msh_pool_get_stats(pool, &res->st_before_last);
        if (pass + 1 < passes) { /* the loop begins again: everything live is released */
            for (size_t i = 0; i < m.cap; i++) {
                if (!m.t[i].k) continue;
                msh_pool_free(pool, m.t[i].v, MSH_STREAM_COMPLETED);
                m.t[i].k = 0;
            }
            if (o->spill) msh_pool_unspill(pool, false); /* idle host pages go back before the next pass */
        }
        mark_at_free = o->spill && pass + 1 < passes;
    }
    res->wall = wall;
    msh_pool_get_stats(pool, &res->st);
    free(m.t);
    msh_pool_destroy(pool);
    if (!o->use_device) msh_dev_sim_fini(&real);
    return broken;
}

static void print_row_header(void)
{
    printf("%-58s %3s %8s %12s %12s %7s %12s %7s %6s %7s %7s %9s\n", "trace", "dev", "events", "peak_live",
           "reserved", "ratio", "min_capacity", "ratio", "ooms", "maps", "unmaps", "Mev/s");
}

static const char *base_name(const char *p)
{
    const char *s = strstr(p, "traces/");
    return s ? s + 7 : p;
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when the bytes are not valid UTF-8. */
static int utf8_len(const unsigned char *s)
{
    int n = s[0] < 0x80 ? 1 : (s[0] & 0xE0) == 0xC0 ? 2 : (s[0] & 0xF0) == 0xE0 ? 3 : (s[0] & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 2 && s[0] < 0xC2) return 0; /* overlong */
    for (int i = 1; i < n; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return n;
}

/* A JSON string: quotes, backslashes and control bytes escaped; bytes that are not UTF-8 (a file
 * name can hold any byte) become U+FFFD so the line stays valid JSON. */
static void json_str(const char *s)
{
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; p && *p;) {
        int n = utf8_len(p);
        if (!n) {
            fputs("\\ufffd", stdout);
            p++;
        } else if (*p == '"' || *p == '\\') {
            printf("\\%c", *p++);
        } else if (*p < 0x20) {
            printf("\\u%04x", *p++);
        } else {
            fwrite(p, 1, (size_t)n, stdout);
            p += n;
        }
    }
    putchar('"');
}

static int replay_trace(const struct msh_trace_set *set, const struct msh_trace *t, const struct opts *o)
{
    static struct dev_timing tm_store;
    static struct calib calib;
    if (o->use_device) {
        calibrate(t->device, &o->cost, &calib);
        timing_reset(&tm_store);
        dev_timing_now = &tm_store;
    }
    int rc = replay_trace_runs(set, t, o);
    if (o->use_device) {
        if (!rc) {
            if (o->json) {
                json_calib(&calib);
                printf("}\n");
            } else if (calib.ok) {
                printf("    a cost table fitted to one-page and ten-page handles timed on this device "
                       "(%d of each; map includes set_access):\n", CALIB_REPS);
                msh_drvcost_write(stdout, &calib.fit);
            } else {
                printf("    (calibration skipped: a driver call failed)\n");
            }
        }
        timing_reset(&tm_store);
        dev_timing_now = NULL;
    }
    return rc;
}

/* ---- spill (--spill host): what moved, and what it costs by the cost table -------------------- */
struct spill_fig {
    uint64_t to_host, to_dev, pages_to_host, pages_to_dev, refused, rescued;
    double transfer_s; /* host_create + the copies each way (the cost table's rows for them) */
};

static void spill_fig(const struct msh_pool_stats *a, const struct msh_pool_stats *b, const struct msh_drvcost *c,
                      struct spill_fig *f)
{
    static const struct msh_pool_stats zero;
    if (!b) b = &zero;
    f->to_host = a->spill_out_bytes - b->spill_out_bytes;
    f->to_dev = a->spill_in_bytes - b->spill_in_bytes;
    f->pages_to_host = a->spill_out_pages - b->spill_out_pages;
    f->pages_to_dev = a->spill_in_pages - b->spill_in_pages;
    f->refused = a->spill_refused - b->spill_refused;
    f->rescued = a->rescue_spill - b->rescue_spill;
    uint64_t calls[MSH_DRV_NKINDS] = {0}, bytes[MSH_DRV_NKINDS] = {0};
    static const enum msh_drv_call kinds[] = {MSH_DRV_HOST_CREATE, MSH_DRV_COPY_D2H, MSH_DRV_COPY_H2D};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        calls[kinds[i]] = a->drv_calls[kinds[i]] - b->drv_calls[kinds[i]];
        bytes[kinds[i]] = a->drv_bytes[kinds[i]] - b->drv_bytes[kinds[i]];
    }
    f->transfer_s = msh_drvcost_seconds(c, calls, bytes, NULL);
}

/* The least a pass pays reading spilled pages over the link: each byte at its peak once, from the
 * host to the device (the copy_to_device row's rate). */
static double spill_read_lower_bound(const struct msh_pool_stats *s, const struct msh_drvcost *c)
{
    return (double)s->run_peak_spilled_bytes / (1024.0 * 1024.0) * c->per_mib_s[MSH_DRV_COPY_H2D];
}

static const char *link_name(int link) { return link == MSH_LINK_C2C ? "c2c" : "pcie5"; }

static void json_spill(const struct run_result *r, const struct run_result *steady, const struct opts *o)
{
    struct spill_fig f;
    spill_fig(&r->st, NULL, &o->cost, &f);
    printf(",\"spill\":\"host\",\"spill_link\":\"%s\",\"spill_max_bytes\":%llu,\"spilled_peak_bytes\":%zu,"
           "\"spilled_bytes_at_end\":%zu,\"spill_to_host_bytes\":%llu,\"spill_to_device_bytes\":%llu,"
           "\"spill_to_host_pages\":%llu,\"spill_to_device_pages\":%llu,\"spill_rescued_requests\":%llu,"
           "\"spill_refused_requests\":%llu,\"spill_transfer_seconds\":%.6f,\"spill_read_seconds_per_pass_lower_bound\":%.6f",
           link_name(o->link), (unsigned long long)o->spill_max, r->st.run_peak_spilled_bytes, r->st.spilled_bytes,
           (unsigned long long)f.to_host, (unsigned long long)f.to_dev, (unsigned long long)f.pages_to_host,
           (unsigned long long)f.pages_to_dev, (unsigned long long)f.rescued, (unsigned long long)f.refused,
           f.transfer_s, spill_read_lower_bound(&r->st, &o->cost));
    if (steady) {
        spill_fig(&steady->st, &steady->st_before_last, &o->cost, &f);
        printf(",\"steady_spilled_peak_bytes\":%zu,\"last_pass_spill_to_host_bytes\":%llu,"
               "\"last_pass_spill_to_device_bytes\":%llu,\"last_pass_spill_transfer_seconds\":%.6f",
               steady->st.run_peak_spilled_bytes, (unsigned long long)f.to_host, (unsigned long long)f.to_dev,
               f.transfer_s);
    }
}

static void text_spill(const struct run_result *r, const struct run_result *steady, const struct opts *o)
{
    struct spill_fig f;
    spill_fig(&r->st, NULL, &o->cost, &f);
    printf("    spill to host (%s): peak %.1f MiB spilled; %.1f MiB to the host in %llu pages, %.1f MiB back in %llu; "
           "%llu requests served by spilling, %llu refused; transfers %.3f s modelled; reading each spilled byte once "
           "per pass costs at least %.3f s\n",
           link_name(o->link), (double)r->st.run_peak_spilled_bytes / MSH_MiB, (double)f.to_host / MSH_MiB,
           (unsigned long long)f.pages_to_host, (double)f.to_dev / MSH_MiB, (unsigned long long)f.pages_to_dev,
           (unsigned long long)f.rescued, (unsigned long long)f.refused, f.transfer_s,
           spill_read_lower_bound(&r->st, &o->cost));
    if (steady) {
        spill_fig(&steady->st, &steady->st_before_last, &o->cost, &f);
        printf("    spill, last pass: %.1f MiB to the host, %.1f MiB back, transfers %.3f s modelled\n",
               (double)f.to_host / MSH_MiB, (double)f.to_dev / MSH_MiB, f.transfer_s);
    }
}

static int replay_trace_runs(const struct msh_trace_set *set, const struct msh_trace *t, const struct opts *o)
{
    struct run_result unl, main_run, steady;
    bool have_steady = false;
    uint64_t min_cap = 0;
    /* First an unlimited pass: what the pool holds when nothing forces it to reclaim. */
    int rc = replay(t, o, 0, 1, &unl);
    if (rc) return rc;
    uint64_t cap = o->capacity;
    if (o->auto_cap) {
        /* Placement never depends on what is mapped, so success is monotone in capacity. */
        uint64_t lo = ceil_div(t->peak_live_bytes, o->gran);
        uint64_t hi = ceil_div(unl.st.peak_mapped_bytes, o->gran);
        if (hi < lo) hi = lo;
        /* What the unlimited run held need not be enough under a limit: with no limit the front
         * end serves from its bins, under one it waits (docs/pool.md "The front end"), and the
         * two place differently. The upper end is made one that succeeds. */
        for (;;) {
            struct run_result r;
            if ((rc = replay(t, o, hi * o->gran, 1, &r))) return rc;
            if (!r.ooms) break;
            lo = hi + 1;
            hi += hi / 64 + 1;
        }
        while (lo < hi) {
            uint64_t mid = lo + (hi - lo) / 2;
            struct run_result r;
            if ((rc = replay(t, o, mid * o->gran, 1, &r))) return rc;
            if (r.ooms) lo = mid + 1;
            else hi = mid;
        }
        min_cap = lo * o->gran;
        cap = min_cap;
    }
    if (cap) {
        if ((rc = replay(t, o, cap, 1, &main_run))) return rc;
    } else {
        main_run = unl;
    }
    if (o->passes > 1) {
        /* Steady state: the same stream again at the capacity given (or found), else with no
         * limit, where the first pass ran (the capacity it held is not one a limited pass needs:
         * under a limit the front end waits, and places as the pool alone does). */
        uint64_t c = cap;
        if ((rc = replay(t, o, c, o->passes, &steady))) return rc;
        have_steady = true;
    }
    /* Sustained speed: the stream replayed back to back (~200k events), as a training loop does;
     * a single pass of a few thousand events mostly measures page-table set-up. */
    /* The front end's hit rate with no limit, in the first pass and from the second on (the
     * trace repeated as a training loop repeats its step). */
    /* (on the simulated device only: with --device, the driver calls timed are those of the runs
     * the counts report, and these three passes would add their own) */
    struct run_result fr;
    memset(&fr, 0, sizeof fr);
    if (!o->use_device && (rc = replay(t, o, 0, 3, &fr))) return rc;
    struct run_result timing;
    int tpasses = (int)(200000 / (main_run.events ? main_run.events : 1));
    if (tpasses < 2) tpasses = 2;
    if (tpasses > 100) tpasses = 100;
    if ((rc = replay(t, o, cap, tpasses, &timing))) return rc;
    const struct msh_pool_stats *s = &main_run.st;
    double evps = timing.wall > 0 ? (double)timing.events / timing.wall : 0;
    double evps1 = main_run.wall > 0 ? (double)main_run.events / main_run.wall : 0;
    /* the replay packs the learned step on its own thread (plan_sync): its wall holds the
     * packing, which a job's pool does on its planner thread instead */
    double plan_s = (double)timing.st.plan_pack_ns / 1e9;
    double evps_np = timing.wall > plan_s ? (double)timing.events / (timing.wall - plan_s) : 0;
    if (o->json) {
        printf("{\"trace\":");
        json_str(set->path);
        printf(",\"device\":%d,\"policy\":\"memshim\",\"format\":\"%s\",\"events\":%zu,"
               "\"replayed_events\":%llu,\"allocs\":%zu,\"prefix_blocks\":%zu,\"warnings\":%zu,"
               "\"peak_live_bytes\":%llu,\"peak_reserved_bytes\":%zu,\"unlimited_peak_reserved_bytes\":%zu,"
               "\"peak_touched_bytes\":%zu,\"capacity_bytes\":%llu,\"max_handle_bytes\":%llu,",
               t->device, set->format, t->nraw_events, (unsigned long long)main_run.events,
               t->nallocs, t->nprefix, t->warnings, (unsigned long long)t->peak_live_bytes, s->peak_mapped_bytes,
               unl.st.peak_mapped_bytes, unl.st.peak_touched_bytes, (unsigned long long)cap,
               (unsigned long long)o->max_handle);
        if (o->auto_cap) printf("\"min_capacity_bytes\":%llu,", (unsigned long long)min_cap);
        else printf("\"min_capacity_bytes\":null,");
        printf("\"recorded_peak_reserved_bytes\":%llu,\"ooms\":%llu,\"map_ops\":%llu,\"unmap_ops\":%llu,"
               "\"reclaimed_pages\":%llu,\"wall_seconds\":%.6f,\"events_per_second\":%.0f,"
               "\"first_pass_events_per_second\":%.0f,\"planner_seconds\":%.6f,\"events_per_second_excluding_planner\":%.0f",
               (unsigned long long)t->recorded_peak_reserved, (unsigned long long)main_run.ooms,
               (unsigned long long)s->map_ops, (unsigned long long)s->unmap_ops,
               (unsigned long long)s->reclaimed_pages, main_run.wall, evps, evps1, plan_s, evps_np);
        /* the learned step (docs/pool.md): plans switched to, allocations placed by one, plans dropped */
        printf(",\"plans_built\":%llu,\"plan_placed\":%llu,\"plan_dropped\":%llu", (unsigned long long)s->plans_built,
               (unsigned long long)s->plan_placed, (unsigned long long)s->plan_dropped);
        /* the front end (docs/pool.md): allocations served from a bin with no limit, in the first
         * pass and in passes 2-3 */
        if (o->use_device)
            printf(",\"front_hits\":null,\"front_misses\":null,\"front_drains\":null,\"front_later_hits\":null,"
                   "\"front_later_misses\":null");
        else
            printf(",\"front_hits\":%llu,\"front_misses\":%llu,\"front_drains\":%llu,\"front_later_hits\":%llu,"
                   "\"front_later_misses\":%llu",
                   (unsigned long long)fr.st_pass1.front_hits, (unsigned long long)fr.st_pass1.front_misses,
                   (unsigned long long)fr.st_pass1.front_drains,
                   (unsigned long long)(fr.st.front_hits - fr.st_pass1.front_hits),
                   (unsigned long long)(fr.st.front_misses - fr.st_pass1.front_misses));
        json_drv("", DRV_(main_run.st_pass1), &o->cost);
        printf(",\"unlimited_driver_seconds\":%.6f",
               msh_drvcost_seconds(&o->cost, DRV_(unl.st_pass1)));
        if (have_steady) {
            printf(",\"passes\":%d,\"steady_capacity_bytes\":%llu,\"steady_map_ops\":%llu,\"steady_unmap_ops\":%llu,"
                   "\"steady_ooms\":%llu,\"last_pass_map_ops\":%llu,\"last_pass_unmap_ops\":%llu",
                   o->passes, (unsigned long long)cap,
                   (unsigned long long)(steady.st.map_ops - steady.st_pass1.map_ops),
                   (unsigned long long)(steady.st.unmap_ops - steady.st_pass1.unmap_ops),
                   (unsigned long long)steady.ooms,
                   (unsigned long long)(steady.st.map_ops - steady.st_before_last.map_ops),
                   (unsigned long long)(steady.st.unmap_ops - steady.st_before_last.unmap_ops));
            printf(",\"steady_plans_built\":%llu,\"steady_plan_placed\":%llu,\"steady_plan_dropped\":%llu,"
                   "\"last_pass_plans_built\":%llu,\"last_pass_plan_placed\":%llu,\"last_pass_plan_dropped\":%llu",
                   (unsigned long long)(steady.st.plans_built - steady.st_pass1.plans_built),
                   (unsigned long long)(steady.st.plan_placed - steady.st_pass1.plan_placed),
                   (unsigned long long)(steady.st.plan_dropped - steady.st_pass1.plan_dropped),
                   (unsigned long long)(steady.st.plans_built - steady.st_before_last.plans_built),
                   (unsigned long long)(steady.st.plan_placed - steady.st_before_last.plan_placed),
                   (unsigned long long)(steady.st.plan_dropped - steady.st_before_last.plan_dropped));
            printf(",\"steady_front_hits\":%llu,\"steady_front_misses\":%llu,\"steady_front_kept\":%llu",
                   (unsigned long long)(steady.st.front_hits - steady.st_pass1.front_hits),
                   (unsigned long long)(steady.st.front_misses - steady.st_pass1.front_misses),
                   (unsigned long long)(steady.st.front_kept - steady.st_pass1.front_kept));
            DRV_LAST_(steady.st, steady.st_before_last);
            json_drv("steady_", lc, lb, lm, &o->cost);
        }
        if (o->spill) json_spill(&main_run, have_steady ? &steady : NULL, o);
        if (dev_timing_now) json_timing(dev_timing_now); /* the object is closed by replay_trace() after the calibration */
        else printf("}\n");
    } else {
        double pl = t->peak_live_bytes ? (double)t->peak_live_bytes : 1;
        printf("%-58.58s %3d %8zu %12llu %12zu %7.4f %12llu %7.4f %6llu %7llu %7llu %9.2f\n", base_name(set->path),
               t->device, t->nraw_events, (unsigned long long)t->peak_live_bytes, unl.st.peak_mapped_bytes,
               (double)unl.st.peak_mapped_bytes / pl, (unsigned long long)min_cap, (double)min_cap / pl,
               (unsigned long long)main_run.ooms, (unsigned long long)s->map_ops, (unsigned long long)s->unmap_ops,
               evps / 1e6);
        printf("    driver time, first pass (modelled): ");
        text_drv(DRV_(main_run.st_pass1), &o->cost);
        printf("\n");
        if (have_steady) {
            printf("    steady state (passes 2-%d at %llu bytes, 0: no limit): %llu maps, %llu unmaps, %llu OOMs; last pass: %llu maps, "
                   "%llu unmaps, driver ",
                   o->passes, (unsigned long long)cap,
                   (unsigned long long)(steady.st.map_ops - steady.st_pass1.map_ops),
                   (unsigned long long)(steady.st.unmap_ops - steady.st_pass1.unmap_ops),
                   (unsigned long long)steady.ooms,
                   (unsigned long long)(steady.st.map_ops - steady.st_before_last.map_ops),
                   (unsigned long long)(steady.st.unmap_ops - steady.st_before_last.unmap_ops));
            DRV_LAST_(steady.st, steady.st_before_last);
            text_drv(lc, lb, lm, &o->cost);
            printf("\n");
        }
        if (o->spill) text_spill(&main_run, have_steady ? &steady : NULL, o);
        if (dev_timing_now) text_timing(dev_timing_now);
    }
    return 0;
}

/* ---- the policies behind policy.h: torch models and memshim through one runner ---------------- */
struct loaded {
    struct msh_trace_set *set;
    struct msh_snap_extra *x; /* snapshots only */
};

static const struct msh_snap_dev *extra_for(const struct loaded *L, size_t d)
{
    return L->x && d < L->x->ndev ? &L->x->dev[d] : NULL;
}

struct prun {
    struct msh_policy_stats st;             /* after the last pass */
    struct msh_policy_stats st_pass1;       /* after the first pass */
    struct msh_policy_stats st_before_last; /* after the events of the pass before the last one */
    uint64_t ooms;          /* failed requests (seeding past the capacity counts one), every pass */
    uint64_t ooms_pass1;    /* the same, first pass only */
    size_t events;          /* stream events replayed */
    size_t placed;          /* prefix blocks seeded in place */
    size_t addr_match;      /* allocations at the address the recording gave them */
    size_t recorded_allocs; /* allocations of the recorded window */
    double wall;
    bool seeded;
    /* issue 26's fragmentation figures (docs/reports.md), each pass one step with its peaks reset
     * at its start: every pass's peak live over its peak reserved; the peaks over all passes; the
     * reserve and live bytes at the first allocation that saw the highest reserve */
    struct msh_stepfig_summary step;
    uint64_t peak_live, peak_reserved, at_peak_reserved, at_peak_live;
};

/* Replay t through one policy at `capacity`, `passes` times in a row (the live set is released
 * between passes, as in replay()); events, allocations and wall time count the first pass only.
 * With keep, the policy is handed back (for its log). */
static int policy_replay(const struct msh_trace *t, const struct msh_snap_dev *d, enum msh_policy_kind kind,
                         const struct msh_torch_conf *conf, const struct opts *o, uint64_t capacity, int passes,
                         bool log, struct prun *r, struct msh_policy **keep)
{
    memset(r, 0, sizeof *r);
    struct msh_policy *p = NULL;
    int rc = kind == MSH_POLICY_MEMSHIM ? msh_memshim_policy_create(capacity, o->gran, t->peak_live_bytes, &p)
                                        : msh_policy_create(kind, capacity, conf, o->gran, &p);
    if (rc) {
        fprintf(stderr, "memshim-replay: cannot create the %s policy (error %d)\n", msh_policy_name(kind), rc);
        return rc;
    }
    struct amap m;
    uint8_t *placed = calloc(t->nprefix + 1, 1);
    if (!placed || amap_init(&m, t->n)) {
        free(placed);
        msh_policy_destroy(p);
        return ENOMEM;
    }
    bool torch = kind != MSH_POLICY_MEMSHIM;
    if (torch && log) msh_torch_log_segments(p, true);
    double t0 = now_s();
    if (torch && d && !o->torch_empty_start && p->kind == MSH_POLICY_TORCH) {
        r->placed = msh_torch_seed_from_snapshot(p, t, d, conf, placed);
        struct msh_policy_stats s0;
        msh_policy_get_stats(p, &s0);
        r->seeded = s0.seeded_bytes > 0;
        for (size_t i = 0; i < t->nprefix; i++)
            if (placed[i]) *amap_get(&m, t->ev[i].addr, true) = t->ev[i].addr;
        if (capacity && s0.reserved > capacity) {
            /* the recorded state does not fit: what an OOM retry would free first */
            msh_policy_empty_cache(p);
            msh_policy_get_stats(p, &s0);
            if (s0.reserved > capacity) r->ooms++;
        }
    }
    /* emptyCache() calls show in a snapshot only as segment_free events: replay them there */
    size_t nrel = 0, *rel = NULL;
    if (torch && d && d->nev) {
        rel = malloc(d->nev * sizeof *rel);
        for (size_t i = 0; rel && i < d->nev; i++)
            if (d->ev[i].op == MSH_SEG_FREE && (!nrel || rel[nrel - 1] != d->ev[i].at)) rel[nrel++] = d->ev[i].at;
    }
    struct msh_stepfig *sf = malloc(sizeof *sf);
    if (sf) msh_stepfig_reset(sf);
    for (int pass = 0; pass < passes; pass++) {
        size_t ri = 0;
        bool first = pass == 0;
        msh_policy_reset_peaks(p);
        for (size_t i = 0; i < t->n; i++) {
            const struct msh_trace_event *e = &t->ev[i];
            if (torch) msh_torch_set_clock(p, i);
            while (ri < nrel && rel[ri] <= i) {
                msh_policy_empty_cache(p);
                ri++;
            }
            if (first) r->events++;
            if (e->op == MSH_OP_ALLOC) {
                if (first && i < t->nprefix && placed[i]) continue;
                uint64_t *slot = amap_get(&m, e->addr, true);
                if (*slot) continue;
                uint64_t a = 0;
                if (msh_policy_alloc(p, e->size, e->stream, &a)) {
                    r->ooms++;
                    amap_del(&m, e->addr);
                    continue;
                }
                *slot = a;
                if (first && !e->prefix) {
                    r->recorded_allocs++;
                    r->addr_match += a == e->addr;
                }
            } else {
                uint64_t *slot = amap_get(&m, e->addr, false);
                if (!slot) continue;
                msh_policy_free(p, *slot, e->stream);
                amap_del(&m, e->addr);
            }
        }
        while (ri < nrel) { /* a release recorded after the last event */
            msh_policy_empty_cache(p);
            ri++;
        }
        if (torch) msh_torch_set_clock(p, t->n);
        if (first) {
            r->wall = now_s() - t0;
            r->ooms_pass1 = r->ooms;
            msh_policy_get_stats(p, &r->st_pass1);
        }
        struct msh_policy_stats ps;
        msh_policy_get_stats(p, &ps);
        if (sf && ps.peak_reserved) msh_stepfig_note(sf, (double)ps.peak_live_bytes / (double)ps.peak_reserved);
        if (ps.peak_live_bytes > r->peak_live) r->peak_live = ps.peak_live_bytes;
        if (ps.peak_reserved > r->peak_reserved) r->peak_reserved = ps.peak_reserved;
        if (first || ps.at_peak_reserved > r->at_peak_reserved) { /* the first pass to reach the highest */
            r->at_peak_reserved = ps.at_peak_reserved;
            r->at_peak_live = ps.at_peak_live;
        }
        if (pass + 2 == passes) msh_policy_get_stats(p, &r->st_before_last);
        if (pass + 1 < passes) { /* the loop begins again: everything live is released */
            for (size_t i = 0; i < m.cap; i++) {
                if (!m.t[i].k) continue;
                msh_policy_free(p, m.t[i].v, MSH_STREAM_COMPLETED);
                m.t[i].k = 0;
            }
        }
    }
    msh_policy_get_stats(p, &r->st);
    if (sf) msh_stepfig_summarize(sf, &r->step);
    free(sf);
    free(rel);
    free(m.t);
    free(placed);
    if (keep) *keep = p;
    else msh_policy_destroy(p);
    return 0;
}

/* The later passes of a multi-pass policy run: ,"passes",...,"steady_driver_*" */
static void json_policy_steady(const struct prun *r, const struct opts *o, uint64_t cap)
{
    printf(",\"passes\":%d,\"steady_capacity_bytes\":%llu,\"steady_map_ops\":%llu,\"steady_unmap_ops\":%llu,"
           "\"steady_segments_created\":%llu,\"steady_segments_freed\":%llu,\"steady_ooms\":%llu,"
           "\"last_pass_map_ops\":%llu,\"last_pass_unmap_ops\":%llu",
           o->passes, (unsigned long long)cap, (unsigned long long)(r->st.map_ops - r->st_pass1.map_ops),
           (unsigned long long)(r->st.unmap_ops - r->st_pass1.unmap_ops),
           (unsigned long long)(r->st.segs_created - r->st_pass1.segs_created),
           (unsigned long long)(r->st.segs_freed - r->st_pass1.segs_freed), (unsigned long long)(r->ooms - r->ooms_pass1),
           (unsigned long long)(r->st.map_ops - r->st_before_last.map_ops),
           (unsigned long long)(r->st.unmap_ops - r->st_before_last.unmap_ops));
    DRV_LAST_(r->st, r->st_before_last);
    json_drv("steady_", lc, lb, lm, &o->cost);
}

static double last_pass_seconds(const struct prun *r, const struct opts *o)
{
    DRV_LAST_(r->st, r->st_before_last);
    return msh_drvcost_seconds(&o->cost, lc, lb, lm);
}

/* Smallest capacity (to the granularity) at which the stream replays with no OOM, by bisection
 * between the live peak and what the policy held with no limit. */
static int policy_min_capacity(const struct msh_trace *t, const struct msh_snap_dev *d, enum msh_policy_kind kind,
                               const struct msh_torch_conf *conf, const struct opts *o, uint64_t unlimited_peak,
                               uint64_t *out)
{
    uint64_t g = o->gran;
    uint64_t lo = ceil_div(t->peak_live_bytes, g), hi = ceil_div(unlimited_peak, g);
    if (hi > UINT64_MAX / g) hi = UINT64_MAX / g; /* mid * g must not wrap */
    if (hi < lo) hi = lo;
    struct prun r;
    /* memshim's pool with its front end holds less with no limit than under one (it waits there):
     * the upper end is made one that succeeds, as replay_trace_runs does */
    for (int rc; hi < UINT64_MAX / g / 2;) {
        if ((rc = policy_replay(t, d, kind, conf, o, hi * g, 1, false, &r, NULL))) return rc;
        if (!r.ooms) break;
        lo = hi + 1;
        hi += hi / 64 + 1;
    }
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int rc = policy_replay(t, d, kind, conf, o, mid * g, 1, false, &r, NULL);
        if (rc) return rc;
        if (r.ooms) lo = mid + 1;
        else hi = mid;
    }
    *out = lo * g;
    return 0;
}

/* The torch settings for a trace: --torch-conf on top of the defaults, else the recorded ones. */
static int torch_conf_for(const struct loaded *L, const struct opts *o, enum msh_policy_kind kind,
                          struct msh_torch_conf *c)
{
    msh_torch_conf_default(c);
    if (L->x && L->x->has_settings) *c = L->x->conf;
    else if (L->set->allocator_conf && *L->set->allocator_conf) {
        char err[256];
        if (msh_torch_conf_parse(L->set->allocator_conf, c, err, sizeof err)) msh_torch_conf_default(c);
    }
    if (o->torch_conf) {
        char err[256];
        msh_torch_conf_default(c);
        if (msh_torch_conf_parse(o->torch_conf, c, err, sizeof err)) {
            fprintf(stderr, "memshim-replay: --torch-conf: %s\n", err);
            return EINVAL;
        }
    }
    if (kind == MSH_POLICY_TORCH_EXPANDABLE) c->expandable = true;
    return 0;
}


static void json_sizes(const char *name, const struct msh_segev *ev, size_t n, uint8_t op)
{
    printf(",\"%s\":[", name);
    bool first = true;
    for (size_t i = 0; i < n; i++) {
        if (ev[i].op != op) continue;
        printf("%s%llu", first ? "" : ",", (unsigned long long)ev[i].size);
        first = false;
    }
    printf("]");
}

/* --policy torch|torch-expandable: one device trace through one model. */
static int model_trace(const struct loaded *L, size_t di, const struct opts *o)
{
    const struct msh_trace_set *set = L->set;
    const struct msh_trace *t = &set->dev[di];
    const struct msh_snap_dev *d = extra_for(L, di);
    struct msh_torch_conf conf;
    if (torch_conf_for(L, o, o->policy, &conf)) return EINVAL;
    struct prun unl, main_run;
    struct msh_policy *kept = NULL;
    int rc = policy_replay(t, d, o->policy, &conf, o, 0, 1, o->validate, &unl, o->validate ? &kept : NULL);
    if (rc) return rc;
    uint64_t cap = o->capacity, min_cap = 0;
    if (o->auto_cap) {
        if ((rc = policy_min_capacity(t, d, o->policy, &conf, o, unl.st.peak_reserved, &min_cap))) goto out;
        cap = min_cap;
    }
    if (cap || o->passes > 1) {
        if ((rc = policy_replay(t, d, o->policy, &conf, o, cap, o->passes, false, &main_run, NULL))) goto out;
    } else {
        main_run = unl;
    }
    char cs[512];
    msh_torch_conf_format(&conf, cs, sizeof cs);
    double evps = main_run.wall > 0 ? (double)main_run.events / main_run.wall : 0;
    if (o->json) {
        printf("{\"trace\":");
        json_str(set->path);
        printf(",\"device\":%d,\"policy\":\"%s\",\"format\":\"%s\",\"events\":%zu,\"replayed_events\":%zu,"
               "\"allocs\":%zu,\"prefix_blocks\":%zu,\"warnings\":%zu,\"torch_conf\":",
               t->device, msh_policy_name(o->policy), set->format, t->nraw_events, main_run.events, t->nallocs,
               t->nprefix, t->warnings);
        json_str(cs);
        printf(",\"seeded\":%s,\"seeded_bytes\":%llu,\"prefix_placed\":%zu,\"peak_live_bytes\":%llu,"
               "\"peak_reserved_bytes\":%llu,\"unlimited_peak_reserved_bytes\":%llu,\"final_reserved_bytes\":%llu,"
               "\"capacity_bytes\":%llu,",
               unl.seeded ? "true" : "false", (unsigned long long)unl.st.seeded_bytes, unl.placed,
               (unsigned long long)t->peak_live_bytes, (unsigned long long)main_run.st_pass1.peak_reserved,
               (unsigned long long)unl.st.peak_reserved, (unsigned long long)unl.st.reserved, (unsigned long long)cap);
        if (o->auto_cap) printf("\"min_capacity_bytes\":%llu,", (unsigned long long)min_cap);
        else printf("\"min_capacity_bytes\":null,");
        printf("\"recorded_peak_reserved_bytes\":%llu,\"recorded_final_reserved_bytes\":%llu,\"ooms\":%llu,"
               "\"segments_created\":%llu,\"segments_freed\":%llu,\"map_ops\":%llu,\"unmap_ops\":%llu,"
               "\"alloc_address_matches\":%zu,\"recorded_window_allocs\":%zu,\"wall_seconds\":%.6f,"
               "\"events_per_second\":%.0f",
               (unsigned long long)t->recorded_peak_reserved, (unsigned long long)t->recorded_final_reserved,
               (unsigned long long)main_run.ooms_pass1, (unsigned long long)main_run.st_pass1.segs_created,
               (unsigned long long)main_run.st_pass1.segs_freed, (unsigned long long)main_run.st_pass1.map_ops,
               (unsigned long long)main_run.st_pass1.unmap_ops, unl.addr_match, unl.recorded_allocs, main_run.wall, evps);
        json_drv("", DRV_(main_run.st_pass1), &o->cost);
        printf(",\"unlimited_driver_seconds\":%.6f",
               msh_drvcost_seconds(&o->cost, DRV_(unl.st_pass1)));
        if (o->passes > 1) json_policy_steady(&main_run, o, cap);
        if (o->validate && kept) {
            size_t nlog = 0;
            const struct msh_segev *lg = msh_torch_segment_log(kept, &nlog);
            json_sizes("model_segment_allocs", lg, nlog, MSH_SEG_ALLOC);
            json_sizes("model_segment_frees", lg, nlog, MSH_SEG_FREE);
            json_sizes("model_segment_maps", lg, nlog, MSH_SEG_MAP);
            json_sizes("model_segment_unmaps", lg, nlog, MSH_SEG_UNMAP);
            if (d) {
                json_sizes("recorded_segment_allocs", d->ev, d->nev, MSH_SEG_ALLOC);
                json_sizes("recorded_segment_frees", d->ev, d->nev, MSH_SEG_FREE);
            }
            /* the layout at the end: segments the dump lists that the model does not hold, and back */
            size_t nseg = msh_torch_segments(kept, NULL, 0);
            struct msh_seg_info *si = calloc(nseg + 1, sizeof *si);
            size_t missing = 0, extra = 0;
            if (si && d) {
                msh_torch_segments(kept, si, nseg);
                size_t a = 0, b = 0;
                while (a < nseg || b < d->nseg) {
                    if (b >= d->nseg || (a < nseg && si[a].addr < d->seg[b].addr)) {
                        extra++;
                        a++;
                    } else if (a >= nseg || d->seg[b].addr < si[a].addr) {
                        missing++;
                        b++;
                    } else {
                        if (si[a].size != d->seg[b].size) missing++, extra++;
                        a++;
                        b++;
                    }
                }
            }
            free(si);
            printf(",\"final_segments\":%zu,\"recorded_final_segments\":%zu,\"final_segments_missing\":%zu,"
                   "\"final_segments_extra\":%zu",
                   nseg, d ? d->nseg : 0, missing, extra);
        }
        printf("}\n");
    } else {
        double pl = t->peak_live_bytes ? (double)t->peak_live_bytes : 1;
        printf("%-58.58s %3d %8zu %12llu %12llu %7.4f %12llu %7.4f %6llu %7llu %7llu %9.2f\n", base_name(set->path),
               t->device, t->nraw_events, (unsigned long long)t->peak_live_bytes,
               (unsigned long long)unl.st.peak_reserved, (double)unl.st.peak_reserved / pl,
               (unsigned long long)min_cap, (double)min_cap / pl, (unsigned long long)main_run.ooms_pass1,
               (unsigned long long)main_run.st_pass1.segs_created, (unsigned long long)main_run.st_pass1.segs_freed,
               evps / 1e6);
        printf("    driver time, first pass (modelled): ");
        text_drv(DRV_(main_run.st_pass1), &o->cost);
        printf("\n");
        if (o->passes > 1) {
            DRV_LAST_(main_run.st, main_run.st_before_last);
            printf("    last of %d passes: %llu maps, %llu unmaps, %llu OOMs, driver ", o->passes,
                   (unsigned long long)(main_run.st.map_ops - main_run.st_before_last.map_ops),
                   (unsigned long long)(main_run.st.unmap_ops - main_run.st_before_last.unmap_ops),
                   (unsigned long long)(main_run.ooms - main_run.ooms_pass1));
            text_drv(lc, lb, lm, &o->cost);
            printf("\n");
        }
    }
out:
    msh_policy_destroy(kept);
    return rc;
}

/* ,"peak_allocated_over_peak_reserved":..,"step_allocated_over_reserved":{..},"reserved_minus_..":..
 * of a run with no limit, as the epoch reports define them (docs/reports.md), a pass a step. */
static void json_fragmentation(const struct prun *u)
{
    printf(",\"peak_allocated_over_peak_reserved\":%.6f,\"step_allocated_over_reserved\":",
           u->peak_reserved ? (double)u->peak_live / (double)u->peak_reserved : 1.0);
    if (u->step.steps)
        printf("{\"min\":%.6f,\"median\":%.6f,\"max\":%.6f,\"steps\":%llu}", u->step.min, u->step.median,
               u->step.max, (unsigned long long)u->step.steps);
    else
        printf("null");
    printf(",\"reserved_minus_allocated_at_peak_bytes\":%lld",
           (long long)u->at_peak_reserved - (long long)u->at_peak_live);
}

/* --compare: the three policies side by side for one device trace. */
struct cmp_row {
    uint64_t unl_peak, min_cap, ooms_at_cap, maps, unmaps, segs, segs_freed;
    bool seeded;
    struct prun unl, at_min; /* no limit (one pass); at the minimum (--passes passes) */
};

static int compare_trace(const struct loaded *L, size_t di, const struct opts *o, bool *header)
{
    const struct msh_trace_set *set = L->set;
    const struct msh_trace *t = &set->dev[di];
    const struct msh_snap_dev *d = extra_for(L, di);
    static const enum msh_policy_kind kinds[3] = {MSH_POLICY_MEMSHIM, MSH_POLICY_TORCH, MSH_POLICY_TORCH_EXPANDABLE};
    struct cmp_row row[3];
    char cs[512] = "";
    double t0 = now_s();
    for (int k = 0; k < 3; k++) {
        struct msh_torch_conf conf;
        if (torch_conf_for(L, o, kinds[k], &conf)) return EINVAL;
        if (k == 1) msh_torch_conf_format(&conf, cs, sizeof cs);
        if (kinds[k] == MSH_POLICY_TORCH) conf.expandable = false;
        struct prun u, r;
        /* no limit, --passes passes: the fragmentation figures (a pass is a step); the rest is
         * the first pass's, as with one */
        int rc = policy_replay(t, d, kinds[k], &conf, o, 0, o->passes, false, &u, NULL);
        if (rc) return rc;
        memset(&row[k], 0, sizeof row[k]);
        row[k].unl_peak = u.st_pass1.peak_reserved;
        row[k].seeded = u.seeded;
        if ((rc = policy_min_capacity(t, d, kinds[k], &conf, o, u.st.peak_reserved, &row[k].min_cap))) return rc;
        /* the work at the minimum capacity (memshim: maps/unmaps; torch: cudaMalloc/cudaFree) */
        if ((rc = policy_replay(t, d, kinds[k], &conf, o, row[k].min_cap, o->passes, false, &r, NULL))) return rc;
        row[k].maps = r.st_pass1.map_ops;
        row[k].unmaps = r.st_pass1.unmap_ops;
        row[k].segs = r.st_pass1.segs_created;
        row[k].segs_freed = r.st_pass1.segs_freed;
        row[k].unl = u;
        row[k].at_min = r;
        if (o->capacity) {
            if ((rc = policy_replay(t, d, kinds[k], &conf, o, o->capacity, 1, false, &r, NULL))) return rc;
            row[k].ooms_at_cap = r.ooms;
        }
    }
    double wall = now_s() - t0;
    double pl = t->peak_live_bytes ? (double)t->peak_live_bytes : 1;
    if (o->json) {
        printf("{\"trace\":");
        json_str(set->path);
        printf(",\"device\":%d,\"events\":%zu,\"peak_live_bytes\":%llu,\"recorded_peak_reserved_bytes\":%llu,"
               "\"capacity_bytes\":%llu,\"capacity_name\":",
               t->device, t->nraw_events, (unsigned long long)t->peak_live_bytes,
               (unsigned long long)t->recorded_peak_reserved, (unsigned long long)o->capacity);
        if (o->capacity_name) json_str(o->capacity_name);
        else printf("null");
        printf(",\"torch_conf\":");
        json_str(cs);
        printf(",\"wall_seconds\":%.3f,\"policies\":{", wall);
        for (int k = 0; k < 3; k++) {
            printf("%s\"%s\":{\"min_capacity_bytes\":%llu,\"ratio_to_peak_live\":%.4f,"
                   "\"unlimited_peak_reserved_bytes\":%llu,\"map_ops\":%llu,\"unmap_ops\":%llu,"
                   "\"segments_created\":%llu,\"segments_freed\":%llu,\"seeded\":%s",
                   k ? "," : "", msh_policy_name(kinds[k]), (unsigned long long)row[k].min_cap,
                   (double)row[k].min_cap / pl, (unsigned long long)row[k].unl_peak, (unsigned long long)row[k].maps,
                   (unsigned long long)row[k].unmaps, (unsigned long long)row[k].segs,
                   (unsigned long long)row[k].segs_freed, row[k].seeded ? "true" : "false");
            if (o->capacity) {
                bool fits = row[k].min_cap <= o->capacity && !row[k].ooms_at_cap;
                printf(",\"ooms_at_capacity\":%llu,\"fits\":%s,\"short_bytes\":%llu,\"headroom_bytes\":%llu",
                       (unsigned long long)row[k].ooms_at_cap, fits ? "true" : "false",
                       (unsigned long long)(row[k].min_cap > o->capacity ? row[k].min_cap - o->capacity : 0),
                       (unsigned long long)(row[k].min_cap < o->capacity ? o->capacity - row[k].min_cap : 0));
            }
            /* driver work: first pass at the minimum capacity (the row's other figures), and with no limit */
            const struct prun *r = &row[k].at_min, *u = &row[k].unl;
            json_drv("", DRV_(r->st_pass1), &o->cost);
            json_drv("unlimited_", DRV_(u->st_pass1), &o->cost);
            if (o->passes > 1) json_policy_steady(r, o, row[k].min_cap);
            json_fragmentation(u);
            printf("}");
        }
        printf("}}\n");
        return 0;
    }
    if (!*header) {
        printf("%-44s %3s %10s | %-27s | %-27s | %-27s\n", "trace", "dev", "live MiB", "memshim: min MiB  x live",
               "torch: min MiB  x live", "torch-expandable: min MiB  x");
        *header = true;
    }
    printf("%-44.44s %3d %10.0f", base_name(set->path), t->device, (double)t->peak_live_bytes / MSH_MiB);
    for (int k = 0; k < 3; k++)
        printf(" | %14.0f %7.4f%s   ", (double)row[k].min_cap / MSH_MiB, (double)row[k].min_cap / pl,
               k == 1 && row[k].seeded ? "*" : " ");
    printf("\n    memshim at its minimum: %llu maps, %llu unmaps; torch: %llu cudaMalloc%s\n",
           (unsigned long long)row[0].maps, (unsigned long long)row[0].unmaps, (unsigned long long)row[1].segs,
           row[1].seeded ? " (* seeded with the recorded segments)" : "");
    printf("    driver time, first pass (modelled) at each one's minimum:");
    for (int k = 0; k < 3; k++)
        printf(" %s %.3f s%s", msh_policy_name(kinds[k]),
               msh_drvcost_seconds(&o->cost, DRV_(row[k].at_min.st_pass1)),
               k < 2 ? "," : ";");
    printf(" with no limit:");
    for (int k = 0; k < 3; k++)
        printf(" %s %.3f s%s", msh_policy_name(kinds[k]),
               msh_drvcost_seconds(&o->cost, DRV_(row[k].unl.st_pass1)),
               k < 2 ? "," : "\n");
    if (o->passes > 1) {
        printf("    last of %d passes at the minimum:", o->passes);
        for (int k = 0; k < 3; k++) {
            const struct prun *r = &row[k].at_min;
            printf(" %s %llu maps, %llu unmaps, %llu cudaMalloc, %.3f s%s", msh_policy_name(kinds[k]),
                   (unsigned long long)(r->st.map_ops - r->st_before_last.map_ops),
                   (unsigned long long)(r->st.unmap_ops - r->st_before_last.unmap_ops),
                   (unsigned long long)(r->st.segs_created - r->st_before_last.segs_created), last_pass_seconds(r, o),
                   k < 2 ? ";" : "\n");
        }
    }
    printf("    fragmentation with no limit (%d pass%s, a step each):", o->passes, o->passes > 1 ? "es" : "");
    for (int k = 0; k < 3; k++) {
        const struct prun *u = &row[k].unl;
        char sr[64] = "n/a";
        if (u->step.steps) snprintf(sr, sizeof sr, "%.3f/%.3f/%.3f", u->step.min, u->step.median, u->step.max);
        printf(" %s: step allocated/reserved %s, peak allocated/reserved %.3f, reserved - allocated "
               "at the peak %.0f MiB%s",
               msh_policy_name(kinds[k]), sr,
               u->peak_reserved ? (double)u->peak_live / (double)u->peak_reserved : 1.0,
               ((double)u->at_peak_reserved - (double)u->at_peak_live) / MSH_MiB, k < 2 ? ";" : "\n");
    }
    if (o->capacity) {
        printf("    at %s (%.0f MiB):", o->capacity_name ? o->capacity_name : "the capacity",
               (double)o->capacity / MSH_MiB);
        for (int k = 0; k < 3; k++) {
            bool fits = row[k].min_cap <= o->capacity && !row[k].ooms_at_cap;
            if (fits)
                printf(" %s fits (%.0f MiB to spare)%s", msh_policy_name(kinds[k]),
                       (double)(o->capacity - row[k].min_cap) / MSH_MiB, k < 2 ? ";" : "");
            else
                printf(" %s does not fit (%.0f MiB short, %llu OOMs)%s", msh_policy_name(kinds[k]),
                       (double)(row[k].min_cap - (row[k].min_cap > o->capacity ? o->capacity : row[k].min_cap)) / MSH_MiB,
                       (unsigned long long)row[k].ooms_at_cap, k < 2 ? ";" : "");
        }
        printf("\n");
    }
    return 0;
}

/* A snapshot read again for the models' extra output (segment events, layout, settings). */
static int load_extra(const char *path, struct loaded *L, char *err, size_t errlen)
{
    if (!L->set->format || strcmp(L->set->format, "pytorch-snapshot")) return 0;
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    unsigned char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len == cap) {
            size_t nc = cap ? cap * 2 : 1 << 20;
            if (nc > MSH_TRACE_MAX_FILE + 1) break;
            unsigned char *n = realloc(buf, nc);
            if (!n) break;
            buf = n;
            cap = nc;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        if (!r) break;
        len += r;
    }
    fclose(f);
    struct msh_trace_set *s2 = NULL;
    struct msh_snap_extra *x = NULL;
    int rc = buf ? msh_snapshot_load_extra(buf, len, &s2, &x, err, errlen) : ENOMEM;
    free(buf);
    if (rc) return rc;
    free(s2->path);
    s2->path = strdup(L->set->path);
    msh_trace_set_free(L->set);
    L->set = s2;
    L->x = x;
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: memshim-replay [options] TRACE...\n"
            "Replay PyTorch memory snapshots (torch.cuda.memory._dump_snapshot pickles), torch.profiler\n"
            "traces (profile_memory=True; .json or .json.gz) or memshim traces through memshim's pool\n"
            "and report what it needed.\n\n"
            "  --capacity SIZE|auto  simulate a device of SIZE bytes (40G, 512MiB...); auto searches\n"
            "                        the smallest capacity (to the granularity) with no OOM\n"
            "  --passes N            replay the stream N times in a row (N=2: steady state); the last\n"
            "                        pass is reported as the steady state (also with --policy/--compare)\n"
            "  --json                one JSON object per device trace\n"
            "  --granularity SIZE    page size of the simulated device (default 2MiB)\n"
            "  --small-max SIZE      requests up to SIZE use the small region (default 1MiB)\n"
            "  --no-defrag           never reclaim and remap pages\n"
            "  --device              use the CUDA driver present instead of the simulation; times every\n"
            "                        driver call (median, p90) and fits a cost table to the driver\n"
            "  --driver-costs FILE   the cost table for modelled driver seconds: lines 'KIND PER_CALL\n"
            "                        [PER_MIB [PER_MAPPING]]' (e.g. 'create 8us 0.04us'); kinds not\n"
            "                        named keep the default\n"
            "  --show-driver-costs   print the cost table in force (defaults, or FILE) and exit\n"
            "  --print-driver-costs  the same as JSON, keyed by driver function (cuMemCreate: per_call_us,\n"
            "                        per_mib_us, per_mapping_us), and exit\n"
            "  --to-text             print the traces in memshim's text format and exit\n"
            "  --check               verify the pool's invariants during the replay (after every\n"
            "                        event of short streams; a violation exits 3)\n"
            "  --max-handle SIZE     the pool's largest physical handle (default: no cap; one page,\n"
            "                        e.g. 2MiB, is the page model: one handle per page)\n"
            "  --no-learn            best-fit placement only, never the learned step (to compare)\n"
            "  --no-front            the pool without its front end of exact-size bins (to compare)\n"
            "  --spill host          past --capacity, cold pages move to host memory behind the same\n"
            "                        addresses (MEMSHIM_SPILL=host; needs an explicit --capacity, which\n"
            "                        may be below the live peak): spilled bytes, transfers each way,\n"
            "                        modelled transfer seconds (fields with 'spill' in --json)\n"
            "  --spill-max SIZE      host bytes spilled pages may take (default: no cap)\n"
            "  --link pcie5|c2c      the host link the copies' cost models: PCIe Gen5 x16 (default) or\n"
            "                        Grace Hopper NVLink-C2C (docs/benchmarks.md, driver cost table)\n"
            "  --debug               the pool's debug log on stderr (the learned step: steps found,\n"
            "                        packed, switched to and dropped; with --capacity auto, of every try)\n"
            "  --policy P            memshim (default), torch (PyTorch's caching allocator, modelled)\n"
            "                        or torch-expandable (expandable_segments:True, modelled)\n"
            "  --torch-conf CONF     PYTORCH_CUDA_ALLOC_CONF for the torch policies (max_split_size_mb,\n"
            "                        roundup_power2_divisions, garbage_collection_threshold,\n"
            "                        expandable_segments); default: the snapshot's recorded settings\n"
            "  --torch-start S       recorded (default: seed the torch model with the segments the\n"
            "                        snapshot held when recording began) or empty\n"
            "  --compare             the three policies side by side per device trace: minimum\n"
            "                        capacity, ratio to peak live, OOMs and fit at --capacity\n"
            "  --validate            (torch policies, --json) the model's segment events and final\n"
            "                        layout next to the recorded ones\n"
            "  --capacity also takes a device name:");
    for (size_t i = 0; i < sizeof devices / sizeof devices[0]; i++) fprintf(f, " %s", devices[i].name);
    fprintf(f, "\n"
            "  -h, --help            this text\n"
            "Exit status: 0 done (OOMs are results), 2 bad usage or unreadable/malformed input,\n"
            "3 --check found the pool's invariants broken.\n");
}

int main(int argc, char **argv)
{
    struct opts o = {.gran = 2 * MSH_MiB, .small_max = MSH_MiB, .defrag = true, .passes = 1};
    o.cost = *msh_drvcost_default();
    bool to_text = false, show_costs = false, print_costs = false;
    static const struct option lo[] = {
        {"policy", required_argument, 0, 'P'},   {"torch-conf", required_argument, 0, 'T'},
        {"compare", no_argument, 0, 'C'},        {"validate", no_argument, 0, 'V'},
        {"torch-start", required_argument, 0, 'S'},
        {"capacity", required_argument, 0, 'c'}, {"passes", required_argument, 0, 'p'},
        {"json", no_argument, 0, 'j'},           {"granularity", required_argument, 0, 'g'},
        {"small-max", required_argument, 0, 's'}, {"no-defrag", no_argument, 0, 'n'},
        {"device", no_argument, 0, 'd'},         {"to-text", no_argument, 0, 't'},
        {"driver-costs", required_argument, 0, 'D'}, {"show-driver-costs", no_argument, 0, 'W'},
        {"print-driver-costs", no_argument, 0, 'J'},
        {"check", no_argument, 0, 'K'},        {"max-handle", required_argument, 0, 'M'},
        {"no-learn", no_argument, 0, 'L'},       {"no-front", no_argument, 0, 'F'},       {"debug", no_argument, 0, 'G'},
        {"spill", required_argument, 0, 'X'},    {"spill-max", required_argument, 0, 'Y'},
        {"link", required_argument, 0, 'Z'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'c':
            if (!strcmp(optarg, "auto")) {
                o.auto_cap = true;
            } else if (device_capacity(optarg, &o.capacity, &o.capacity_name) == 0) {
                break;
            } else if (msh_parse_size(optarg, &o.capacity) || !o.capacity) {
                fprintf(stderr, "memshim-replay: --capacity '%s' is not a size (e.g. 24GiB), a device name "
                                "(e.g. A100-80GB; see --help) or 'auto'\n", optarg);
                return 2;
            }
            break;
        case 'P':
            if (msh_policy_parse(optarg, &o.policy)) {
                fprintf(stderr, "memshim-replay: --policy '%s' must be memshim, torch or torch-expandable\n", optarg);
                return 2;
            }
            break;
        case 'T': {
            struct msh_torch_conf tc;
            char err[256];
            msh_torch_conf_default(&tc);
            if (msh_torch_conf_parse(optarg, &tc, err, sizeof err)) {
                fprintf(stderr, "memshim-replay: --torch-conf: %s\n", err);
                return 2;
            }
            o.torch_conf = optarg;
            break;
        }
        case 'S':
            if (!strcmp(optarg, "empty")) o.torch_empty_start = true;
            else if (!strcmp(optarg, "recorded")) o.torch_empty_start = false;
            else {
                fprintf(stderr, "memshim-replay: --torch-start '%s' must be recorded or empty\n", optarg);
                return 2;
            }
            break;
        case 'D': {
            char err[512];
            if (msh_drvcost_load(optarg, &o.cost, err, sizeof err)) {
                fprintf(stderr, "memshim-replay: --driver-costs: %s\n", err);
                return 2;
            }
            break;
        }
        case 'W': show_costs = true; break;
        case 'J': print_costs = true; break;
        case 'C': o.compare = true; break;
        case 'V': o.validate = true; break;
        case 'p': {
            char *end;
            long n = strtol(optarg, &end, 10);
            if (*end || n < 1 || n > 100) {
                fprintf(stderr, "memshim-replay: --passes '%s' must be 1..100\n", optarg);
                return 2;
            }
            o.passes = (int)n;
            break;
        }
        case 'j': o.json = true; break;
        case 'g':
            if (msh_parse_size(optarg, &o.gran) || !o.gran || o.gran % 4096) {
                fprintf(stderr, "memshim-replay: --granularity '%s' must be a multiple of 4KiB\n", optarg);
                return 2;
            }
            break;
        case 's':
            if (msh_parse_size(optarg, &o.small_max)) {
                fprintf(stderr, "memshim-replay: --small-max '%s' is not a size\n", optarg);
                return 2;
            }
            break;
        case 'n': o.defrag = false; break;
        case 'd': o.use_device = true; break;
        case 'K': o.check = true; break;
        case 'L': o.no_learn = true; break;
        case 'F':
            o.no_front = true;
            msh_memshim_policy_front = false; /* the memshim column of --compare too */
            break;
        case 'G': o.debug = true; break;
        case 'X':
            if (!strcmp(optarg, "host")) o.spill = true;
            else if (strcmp(optarg, "off")) {
                fprintf(stderr, "memshim-replay: --spill '%s': expected host or off\n", optarg);
                return 2;
            }
            break;
        case 'Y':
            if (msh_parse_size(optarg, &o.spill_max)) {
                fprintf(stderr, "memshim-replay: --spill-max '%s' is not a size (e.g. 8GiB)\n", optarg);
                return 2;
            }
            break;
        case 'Z':
            if (!strcmp(optarg, "pcie5")) o.link = MSH_LINK_PCIE5;
            else if (!strcmp(optarg, "c2c")) o.link = MSH_LINK_C2C;
            else {
                fprintf(stderr, "memshim-replay: --link '%s': expected pcie5 or c2c\n", optarg);
                return 2;
            }
            break;
        case 'M':
            if (msh_parse_size(optarg, &o.max_handle) || !o.max_handle) {
                fprintf(stderr, "memshim-replay: --max-handle '%s' is not a size (e.g. 2MiB)\n", optarg);
                return 2;
            }
            break;
        case 't': to_text = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (o.max_handle && o.max_handle < o.gran) {
        fprintf(stderr, "memshim-replay: --max-handle must be at least one page (--granularity, default 2MiB)\n");
        return 2;
    }
    if (o.link != MSH_LINK_PCIE5) msh_drvcost_link(&o.cost, o.link); /* after --driver-costs: the link wins */
    if (o.spill && (o.auto_cap || !o.capacity)) {
        fprintf(stderr, "memshim-replay: --spill host needs --capacity SIZE (below the live peak is the point); "
                        "with spill the smallest capacity without an OOM is not a question\n");
        return 2;
    }
    if (o.spill && (o.compare || o.policy != MSH_POLICY_MEMSHIM)) {
        fprintf(stderr, "memshim-replay: --spill replays memshim's pool only (not with --compare or --policy)\n");
        return 2;
    }
    if (show_costs) { /* the table in force, in the format --driver-costs reads */
        msh_drvcost_write(stdout, &o.cost);
        return 0;
    }
    if (print_costs) { /* the same as JSON (docs/replay.md) */
        msh_drvcost_json(stdout, &o.cost);
        return 0;
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    if ((o.compare || o.policy != MSH_POLICY_MEMSHIM) && o.use_device) {
        fprintf(stderr, "memshim-replay: --device replays memshim's pool only (not with --compare or --policy)\n");
        return 2;
    }
    if ((o.compare || o.policy != MSH_POLICY_MEMSHIM) && o.check) {
        fprintf(stderr, "memshim-replay: --check verifies memshim's pool only (not with --compare or --policy)\n");
        return 2;
    }
    if (o.compare && o.auto_cap) o.auto_cap = false; /* --compare always searches the minimum */
    if (o.torch_conf && o.policy == MSH_POLICY_TORCH) {
        struct msh_torch_conf tc;
        char err[256];
        msh_torch_conf_default(&tc);
        msh_torch_conf_parse(o.torch_conf, &tc, err, sizeof err);
        if (tc.expandable) o.policy = MSH_POLICY_TORCH_EXPANDABLE;
    }
    double started = now_s();
    /* OOMs during replay are results, not warnings; --debug: the pool's own account of its
     * learned step (a line per step found, packed, switched to, dropped), on stderr */
    msh_log_level = o.debug ? MSH_LOG_DEBUG : MSH_LOG_ERROR;
    int status = 0;
    bool header = false;
    for (int i = optind; i < argc; i++) {
        struct msh_trace_set *set = NULL;
        char err[512];
        if (msh_trace_load(argv[i], &set, err, sizeof err)) {
            fprintf(stderr, "memshim-replay: %s\n", err);
            status = 2;
            continue;
        }
        if (to_text) {
            msh_trace_write_text(stdout, set);
            msh_trace_set_free(set);
            continue;
        }
        if (o.compare || o.policy != MSH_POLICY_MEMSHIM) {
            struct loaded L = {.set = set};
            if (load_extra(argv[i], &L, err, sizeof err)) {
                fprintf(stderr, "memshim-replay: %s\n", err);
                msh_trace_set_free(L.set);
                status = 2;
                continue;
            }
            if (!o.json && !o.compare && !header) {
                print_row_header();
                header = true;
            }
            for (size_t d = 0; d < L.set->ndev; d++) {
                msh_trace_analyze(&L.set->dev[d]);
                int rc = o.compare ? compare_trace(&L, d, &o, &header) : model_trace(&L, d, &o);
                if (rc) status = 2;
            }
            fflush(stdout);
            msh_snap_extra_free(L.x);
            msh_trace_set_free(L.set);
            continue;
        }
        if (!o.json && !header) {
            print_row_header();
            header = true;
        }
        for (size_t d = 0; d < set->ndev; d++) {
            struct msh_trace *t = &set->dev[d];
            msh_trace_analyze(t);
            int rc = replay_trace(set, t, &o);
            if (rc) status = rc == EFAULT && o.check ? 3 : status == 3 ? 3 : 2;
        }
        fflush(stdout);
        msh_trace_set_free(set);
    }
    if (o.compare && !o.json) printf("(%d input%s compared in %.1f s)\n", argc - optind, argc - optind > 1 ? "s" : "",
                                     now_s() - started);
    return status;
}
