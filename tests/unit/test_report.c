/*
 * test_report.c: report/report.c fed a filled report directly (it is handed data, never calls
 * back: issue 19), its figures read back from the JSON file it writes. Here: memory on the device
 * that memshim did not map, which is the device's used bytes less memshim's, read at two moments
 * (the pool's statistics, then the driver's memory info: a free on another thread in between
 * makes the difference negative, and the report says 0, never a negative size).
 */
#include "harness.h"
#include "msh.h"
#include "report.h"

#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MiB MSH_MiB

static char dir[PATH_MAX];

static json_int_t other_bytes(uint64_t total, uint64_t free_bytes, size_t mapped)
{
    struct msh_report r;
    memset(&r, 0, sizeof r);
    r.kind = "epoch";
    r.reason = "manual";
    r.mode = "tensor";
    r.ndev = 1;
    r.dev[0].device = 0;
    r.dev[0].has_pool = true;
    r.dev[0].st.mapped_bytes = mapped;
    r.dev[0].device_total = total;
    r.dev[0].device_free = free_bytes;
    char path[PATH_MAX];
    if (msh_report_write(&r) || msh_report_path(&r, 0, path, sizeof path)) return -1;
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root) {
        fprintf(stderr, "    %s: %s\n", path, err.text);
        return -1;
    }
    json_t *v = json_object_get(json_object_get(json_object_get(root, "memory"), "not_served_by_memshim"),
                                "other_bytes_on_device");
    json_int_t n = json_is_integer(v) ? json_integer_value(v) : -1;
    json_decref(root);
    unlink(path);
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
    rmdir(dir);
}

TEST_MAIN()
