/*
 * main.c: memshim-replay, which replays recorded allocation streams through the real pool.
 *
 * Input: PyTorch memory snapshots or memshim traces (trace.h). Each device trace replays on its
 * own pool over the simulated device (or, with --device, over the driver that is present), with
 * the block sizes, order and streams of the recording. It answers: how much physical memory does
 * this job need under memshim (--capacity auto searches the minimum), what did the pool do (maps,
 * unmaps, reclaims), and is the loop steady (--passes 2). It never modifies its inputs; an OOM
 * during replay is a result, malformed input an error (exit 2) with the reason.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device.h"
#include "msh.h"
#include "pool.h"
#include "trace.h"

struct opts {
    bool json, use_device, auto_cap;
    uint64_t capacity; /* 0 = unlimited */
    uint64_t gran, small_max;
    bool defrag;
    int passes;
};

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
    struct msh_pool_stats st;       /* after the last pass */
    struct msh_pool_stats st_pass1; /* after the first pass */
    double wall;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int replay(const struct msh_trace *t, const struct opts *o, uint64_t capacity, int passes,
                  struct run_result *res)
{
    memset(res, 0, sizeof *res);
    struct msh_device dev;
    int rc = o->use_device ? msh_dev_cuda_init(&dev, t->device) : msh_dev_sim_init(&dev, 0, o->gran);
    if (rc) {
        fprintf(stderr, "memshim-replay: cannot open the %s device (error %d)\n",
                o->use_device ? "CUDA" : "simulated", rc);
        return rc;
    }
    struct msh_pool_params prm;
    msh_pool_params_default(&prm);
    prm.limit_bytes = capacity;
    prm.small_max = o->small_max;
    prm.defrag = o->defrag;
    /* VA only needs to hold the line: a few times the live peak keeps page tables small. */
    uint64_t base = capacity ? capacity : t->peak_live_bytes;
    prm.va_bytes = base * 4 > 8 * MSH_GiB ? base * 4 : 8 * MSH_GiB;
    struct msh_pool *pool;
    rc = msh_pool_create(&dev, &prm, &pool);
    if (rc) {
        fprintf(stderr, "memshim-replay: cannot create the pool (error %d)\n", rc);
        if (!o->use_device) msh_dev_sim_fini(&dev);
        return rc;
    }
    struct amap m;
    if (amap_init(&m, t->n)) {
        msh_pool_destroy(pool);
        if (!o->use_device) msh_dev_sim_fini(&dev);
        return ENOMEM;
    }
    double t0 = now_s();
    for (int pass = 0; pass < passes; pass++) {
        for (size_t i = 0; i < t->n; i++) {
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
                msh_pool_free(pool, *slot, stream);
                amap_del(&m, e->addr);
            }
        }
        if (pass == 0) msh_pool_get_stats(pool, &res->st_pass1);
        if (pass + 1 < passes) { /* the loop begins again: everything live is released */
            for (size_t i = 0; i < m.cap; i++) {
                if (!m.t[i].k) continue;
                msh_pool_free(pool, m.t[i].v, MSH_STREAM_COMPLETED);
                m.t[i].k = 0;
            }
        }
    }
    res->wall = now_s() - t0;
    msh_pool_get_stats(pool, &res->st);
    free(m.t);
    msh_pool_destroy(pool);
    if (!o->use_device) msh_dev_sim_fini(&dev);
    return 0;
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

static int replay_trace(const struct msh_trace_set *set, const struct msh_trace *t, const struct opts *o)
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
        uint64_t lo = (t->peak_live_bytes + o->gran - 1) / o->gran;
        uint64_t hi = (unl.st.peak_mapped_bytes + o->gran - 1) / o->gran;
        if (hi < lo) hi = lo;
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
        /* Steady state: the same stream again at the capacity the first pass held. */
        uint64_t c = cap ? cap : unl.st.peak_mapped_bytes;
        if ((rc = replay(t, o, c, o->passes, &steady))) return rc;
        have_steady = true;
    }
    /* Sustained speed: the stream replayed back to back (~200k events), as a training loop does;
     * a single pass of a few thousand events mostly measures page-table set-up. */
    struct run_result timing;
    int tpasses = (int)(200000 / (main_run.events ? main_run.events : 1));
    if (tpasses < 2) tpasses = 2;
    if (tpasses > 100) tpasses = 100;
    if ((rc = replay(t, o, cap, tpasses, &timing))) return rc;
    const struct msh_pool_stats *s = &main_run.st;
    double evps = timing.wall > 0 ? (double)timing.events / timing.wall : 0;
    double evps1 = main_run.wall > 0 ? (double)main_run.events / main_run.wall : 0;
    if (o->json) {
        printf("{\"trace\":\"%s\",\"device\":%d,\"policy\":\"memshim\",\"format\":\"%s\",\"events\":%zu,"
               "\"replayed_events\":%llu,\"allocs\":%zu,\"prefix_blocks\":%zu,\"warnings\":%zu,"
               "\"peak_live_bytes\":%llu,\"peak_reserved_bytes\":%zu,\"unlimited_peak_reserved_bytes\":%zu,"
               "\"peak_touched_bytes\":%zu,\"capacity_bytes\":%llu,",
               set->path, t->device, set->format, t->nraw_events, (unsigned long long)main_run.events,
               t->nallocs, t->nprefix, t->warnings, (unsigned long long)t->peak_live_bytes, s->peak_mapped_bytes,
               unl.st.peak_mapped_bytes, unl.st.peak_touched_bytes, (unsigned long long)cap);
        if (o->auto_cap) printf("\"min_capacity_bytes\":%llu,", (unsigned long long)min_cap);
        else printf("\"min_capacity_bytes\":null,");
        printf("\"recorded_peak_reserved_bytes\":%llu,\"ooms\":%llu,\"map_ops\":%llu,\"unmap_ops\":%llu,"
               "\"reclaimed_pages\":%llu,\"wall_seconds\":%.6f,\"events_per_second\":%.0f,"
               "\"first_pass_events_per_second\":%.0f",
               (unsigned long long)t->recorded_peak_reserved, (unsigned long long)main_run.ooms,
               (unsigned long long)s->map_ops, (unsigned long long)s->unmap_ops,
               (unsigned long long)s->reclaimed_pages, main_run.wall, evps, evps1);
        if (have_steady)
            printf(",\"passes\":%d,\"steady_capacity_bytes\":%llu,\"steady_map_ops\":%llu,\"steady_unmap_ops\":%llu,"
                   "\"steady_ooms\":%llu",
                   o->passes, (unsigned long long)(cap ? cap : unl.st.peak_mapped_bytes),
                   (unsigned long long)(steady.st.map_ops - steady.st_pass1.map_ops),
                   (unsigned long long)(steady.st.unmap_ops - steady.st_pass1.unmap_ops),
                   (unsigned long long)steady.ooms);
        printf("}\n");
    } else {
        double pl = t->peak_live_bytes ? (double)t->peak_live_bytes : 1;
        printf("%-58.58s %3d %8zu %12llu %12zu %7.4f %12llu %7.4f %6llu %7llu %7llu %9.2f\n", base_name(set->path),
               t->device, t->nraw_events, (unsigned long long)t->peak_live_bytes, unl.st.peak_mapped_bytes,
               (double)unl.st.peak_mapped_bytes / pl, (unsigned long long)min_cap, (double)min_cap / pl,
               (unsigned long long)main_run.ooms, (unsigned long long)s->map_ops, (unsigned long long)s->unmap_ops,
               evps / 1e6);
        if (have_steady)
            printf("    steady state (pass 2 of %d at %llu bytes): %llu maps, %llu unmaps, %llu OOMs\n", o->passes,
                   (unsigned long long)(cap ? cap : unl.st.peak_mapped_bytes),
                   (unsigned long long)(steady.st.map_ops - steady.st_pass1.map_ops),
                   (unsigned long long)(steady.st.unmap_ops - steady.st_pass1.unmap_ops),
                   (unsigned long long)steady.ooms);
    }
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: memshim-replay [options] TRACE...\n"
            "Replay PyTorch memory snapshots (torch.cuda.memory._dump_snapshot pickles) or memshim\n"
            "traces through memshim's pool and report what it needed.\n\n"
            "  --capacity SIZE|auto  simulate a device of SIZE bytes (40G, 512MiB...); auto searches\n"
            "                        the smallest capacity (to the granularity) with no OOM\n"
            "  --passes N            replay the stream N times in a row (N=2: steady state)\n"
            "  --json                one JSON object per device trace\n"
            "  --granularity SIZE    page size of the simulated device (default 2MiB)\n"
            "  --small-max SIZE      requests up to SIZE use the small region (default 1MiB)\n"
            "  --no-defrag           never reclaim and remap pages\n"
            "  --device              use the CUDA driver present instead of the simulation\n"
            "  --to-text             print the traces in memshim's text format and exit\n"
            "  -h, --help            this text\n"
            "Exit status: 0 done (OOMs are results), 2 bad usage or unreadable/malformed input.\n");
}

int main(int argc, char **argv)
{
    struct opts o = {.gran = 2 * MSH_MiB, .small_max = MSH_MiB, .defrag = true, .passes = 1};
    bool to_text = false;
    static const struct option lo[] = {
        {"capacity", required_argument, 0, 'c'}, {"passes", required_argument, 0, 'p'},
        {"json", no_argument, 0, 'j'},           {"granularity", required_argument, 0, 'g'},
        {"small-max", required_argument, 0, 's'}, {"no-defrag", no_argument, 0, 'n'},
        {"device", no_argument, 0, 'd'},         {"to-text", no_argument, 0, 't'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'c':
            if (!strcmp(optarg, "auto")) {
                o.auto_cap = true;
            } else if (msh_parse_size(optarg, &o.capacity) || !o.capacity) {
                fprintf(stderr, "memshim-replay: --capacity '%s' is not a size (e.g. 24GiB) or 'auto'\n", optarg);
                return 2;
            }
            break;
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
        case 't': to_text = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    msh_log_level = MSH_LOG_ERROR; /* OOMs during replay are results, not warnings */
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
        if (!o.json && !header) {
            print_row_header();
            header = true;
        }
        for (size_t d = 0; d < set->ndev; d++) {
            struct msh_trace *t = &set->dev[d];
            msh_trace_analyze(t);
            if (replay_trace(set, t, &o)) status = 2;
        }
        fflush(stdout);
        msh_trace_set_free(set);
    }
    return status;
}
