/*
 * test_report.c: report/report.c fed a filled report directly (it is handed data, never calls
 * back: issue 19), its figures read back from the JSON file it writes. Here: memory on the device
 * that memshim did not map, which is the device's used bytes less memshim's, read at two moments
 * (the pool's statistics, then the driver's memory info: a free on another thread in between
 * makes the difference negative, and the report says 0, never a negative size). The per-step
 * figure's summary (stepfig.c) and the fragmentation object it ends up in.
 */
#include "harness.h"
#include "msh.h"
#include "report.h"
#include "stepfig.h"

#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MiB MSH_MiB

static char dir[PATH_MAX];

/* An epoch report of one device with a pool (the caller fills its figures). */
static void one_device(struct msh_report *r)
{
    memset(r, 0, sizeof *r);
    r->kind = "epoch";
    r->reason = "manual";
    r->mode = "tensor";
    r->ndev = 1;
    r->dev[0].device = 0;
    r->dev[0].has_pool = true;
}

/* Write it, read the file back (removed), NULL on failure. */
static json_t *write_and_read(const struct msh_report *r)
{
    char path[PATH_MAX];
    if (msh_report_write(r) || msh_report_path(r, 0, path, sizeof path)) return NULL;
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root) fprintf(stderr, "    %s: %s\n", path, err.text);
    unlink(path);
    return root;
}

static json_int_t other_bytes(uint64_t total, uint64_t free_bytes, size_t mapped)
{
    struct msh_report r;
    one_device(&r);
    r.dev[0].st.mapped_bytes = mapped;
    r.dev[0].device_total = total;
    r.dev[0].device_free = free_bytes;
    json_t *root = write_and_read(&r);
    if (!root) return -1;
    json_t *v = json_object_get(json_object_get(json_object_get(root, "memory"), "not_served_by_memshim"),
                                "other_bytes_on_device");
    json_int_t n = json_is_integer(v) ? json_integer_value(v) : -1;
    json_decref(root);
    return n;
}

TEST(memory_others_hold_on_the_device_is_used_less_memshims_and_never_negative)
{
    snprintf(dir, sizeof dir, "/tmp/msh-test-report-%d", (int)getpid());
    snprintf(msh_cfg.report_dir, sizeof msh_cfg.report_dir, "%s", dir);
    REQUIRE(msh_report_init());
    /* 300 MiB used on the device, 100 of them memshim's: 200 MiB are someone else's */
    CHECK(other_bytes(1024 * MiB, 724 * MiB, 100 * MiB) == (json_int_t)(200 * MiB));
    /* the pool mapped 100 MiB when its statistics were read, and had given 60 back by the time the
     * driver was asked: 40 MiB used on the device, fewer than memshim's */
    json_int_t n = other_bytes(1024 * MiB, 984 * MiB, 100 * MiB);
    CHECKF(n == 0, "other_bytes_on_device %lld for 40 MiB used and 100 MiB mapped", (long long)n);
    /* all of it memshim's */
    CHECK(other_bytes(1024 * MiB, 924 * MiB, 100 * MiB) == 0);
}

/* The epoch report's fragmentation object for a device with these figures. */
static json_t *fragmentation_of(const struct msh_stepfig_summary *sr, size_t at_mapped, size_t at_live)
{
    struct msh_report r;
    one_device(&r);
    r.dev[0].st.peak_live_bytes = 6 * MiB;
    r.dev[0].st.peak_mapped_bytes = 8 * MiB;
    r.dev[0].st.at_peak_mapped_bytes = at_mapped;
    r.dev[0].st.at_peak_live_bytes = at_live;
    r.dev[0].step_ratio = *sr;
    json_t *root = write_and_read(&r);
    json_t *frag = root ? json_incref(json_object_get(root, "fragmentation")) : NULL;
    json_decref(root);
    return frag;
}

static double num(json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }

TEST(fragmentation_carries_the_step_figures_and_the_reserve_at_the_peak)
{
    REQUIRE(msh_report_init()); /* the directory of the test above */
    struct msh_stepfig_summary sr = {.steps = 3, .min = 0.5, .median = 0.75, .max = 1.0};
    json_t *f = fragmentation_of(&sr, 8 * MiB, 7 * MiB);
    REQUIRE(f);
    json_t *o = json_object_get(f, "step_allocated_over_reserved");
    CHECK(json_is_object(o) && num(o, "min") == 0.5 && num(o, "median") == 0.75 && num(o, "max") == 1.0 &&
          json_integer_value(json_object_get(o, "steps")) == 3);
    CHECK(json_integer_value(json_object_get(f, "reserved_minus_allocated_at_peak_bytes")) == (json_int_t)MiB);
    CHECK(num(f, "peak_allocated_over_peak_reserved") == 0.75); /* kept: 6 / 8 */
    json_decref(f);
    /* no step measured: null, never a guess; live above the device's reserve (spill): negative */
    memset(&sr, 0, sizeof sr);
    f = fragmentation_of(&sr, 4 * MiB, 6 * MiB);
    REQUIRE(f);
    CHECK(json_is_null(json_object_get(f, "step_allocated_over_reserved")));
    CHECK(json_integer_value(json_object_get(f, "reserved_minus_allocated_at_peak_bytes")) == -(json_int_t)(2 * MiB));
    json_decref(f);
    rmdir(dir);
}

TEST(step_figures_min_median_max_exact_then_a_uniform_sample)
{
    static struct msh_stepfig s; /* 16 KiB: not on the stack */
    struct msh_stepfig_summary o;
    memset(&s, 0, sizeof s);
    msh_stepfig_summarize(&s, &o);
    CHECK(o.steps == 0); /* never noted: nothing to show */
    msh_stepfig_reset(&s);
    /* 0.9, 0.5, 0.7, 0.6: min 0.5, max 0.9, median (0.6 + 0.7) / 2 */
    msh_stepfig_note(&s, 0.9);
    msh_stepfig_note(&s, 0.5);
    msh_stepfig_note(&s, 0.7);
    msh_stepfig_note(&s, 0.6);
    msh_stepfig_summarize(&s, &o);
    CHECKF(o.steps == 4 && o.min == 0.5 && o.max == 0.9 && o.median == (0.6 + 0.7) / 2, "%g %g %g", o.min, o.median,
           o.max);
    msh_stepfig_note(&s, 0.1);
    msh_stepfig_summarize(&s, &o);
    CHECK(o.steps == 5 && o.min == 0.1 && o.median == 0.6);
    /* more steps than are kept: the values are a permutation of 0, 1/n, ..., (n-1)/n; min and max
     * stay exact, the median is that of every 4th step (0, 4, 8, ...: 2047 of them, a uniform
     * sample whose median's standard error is about 0.011) */
    msh_stepfig_reset(&s);
    uint64_t n = 4 * MSH_STEPFIG_KEEP - 5; /* 8187 = 3 x 2729: 7919 (prime) permutes 0..n-1 */
    for (uint64_t i = 0; i < n; i++) msh_stepfig_note(&s, (double)((i * 7919) % n) / (double)n);
    msh_stepfig_summarize(&s, &o);
    CHECK(o.steps == n && o.min == 0.0 && o.max == (double)(n - 1) / (double)n);
    CHECKF(s.stride == 4 && s.nkept == (n + 3) / 4, "stride %u, kept %u", s.stride, s.nkept);
    CHECKF(o.median > 0.45 && o.median < 0.55, "median %g of a uniform 0..1", o.median);
    /* the kept steps are exactly those with i % stride == 0 */
    CHECK(s.kept[1] == (double)((4 * 7919) % n) / (double)n);
}

TEST_MAIN()
