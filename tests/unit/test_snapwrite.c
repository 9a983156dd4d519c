/*
 * test_snapwrite.c: the pickle writer (report/trace/pkwrite.c) read back by memshim's own pickle
 * reader, and the snapshot writer (shim/record/snapwrite.c) over the driver double: the window
 * of events starts where PyTorch's viewer can replay it even when an allocation is in the pool
 * but its alloc event is not in the ring yet (the race between two threads, made deterministic
 * by allocating from the pool directly).
 */
#include "harness.h"
#include "core.h"
#include "history.h"
#include "memshim.h"
#include "msh.h"
#include "pickle.h"
#include "pkwrite.h"
#include "pool.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MiB MSH_MiB

__attribute__((constructor)) static void env(void)
{
    setenv("CUDBL_CAPACITY", "2G", 0);
    setenv("CUDBL_GRANULARITY", "2M", 0);
    setenv("MEMSHIM_LOG", "error", 1);
}

static struct msh_pk_doc *parse(const struct pkw *w)
{
    struct msh_pk_doc *doc = NULL;
    char err[200] = "";
    int rc = msh_pk_parse(w->buf, w->len, NULL, &doc, err, sizeof err);
    if (rc) fprintf(stderr, "    parse: %s\n", err);
    return rc ? NULL : doc;
}

TEST(pickle_scalars_read_back)
{
    static const int64_t ints[] = {0, 1, 255, 256, 65535, 65536, -1, -256, INT32_MIN, INT32_MAX,
                                   (int64_t)INT32_MAX + 1, -((int64_t)1 << 40), INT64_MIN, INT64_MAX,
                                   140422114443264};
    struct pkw w;
    pkw_init(&w);
    pkw_begin(&w);
    pkw_list(&w);
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) pkw_int(&w, ints[i]);
    pkw_uint(&w, UINT64_MAX);
    pkw_float(&w, -2.5);
    pkw_bool(&w, 1);
    pkw_bool(&w, 0);
    pkw_none(&w);
    char longs[300];
    memset(longs, 'x', sizeof longs);
    pkw_strn(&w, longs, sizeof longs);
    pkw_str(&w, "h\xc3\xa9");
    pkw_tuple2_int(&w, 0, 7);
    pkw_close(&w);
    pkw_end(&w);
    REQUIRE(w.err == 0);
    struct msh_pk_doc *doc = parse(&w);
    REQUIRE(doc);
    const struct msh_pk *l = msh_pk_root(doc);
    size_t n = sizeof ints / sizeof *ints;
    REQUIRE(l->kind == MSH_PK_LIST && msh_pk_len(l) == n + 8);
    for (size_t i = 0; i < n; i++) {
        int64_t v = 0;
        CHECKF(msh_pk_get_i64(msh_pk_item(l, i), &v) == 0 && v == ints[i], "item %zu: %lld", i, (long long)ints[i]);
    }
    uint64_t u = 0;
    CHECK(msh_pk_get_u64(msh_pk_item(l, n), &u) == 0 && u == UINT64_MAX);
    CHECK(msh_pk_item(l, n + 1)->kind == MSH_PK_FLOAT && msh_pk_item(l, n + 1)->f == -2.5);
    CHECK(msh_pk_item(l, n + 2)->kind == MSH_PK_BOOL && msh_pk_item(l, n + 2)->i == 1);
    CHECK(msh_pk_item(l, n + 3)->kind == MSH_PK_BOOL && msh_pk_item(l, n + 3)->i == 0);
    CHECK(msh_pk_item(l, n + 4)->kind == MSH_PK_NONE);
    const struct msh_pk *s = msh_pk_item(l, n + 5);
    CHECK(s->kind == MSH_PK_STR && s->s.len == sizeof longs && !memcmp(s->s.p, longs, sizeof longs));
    CHECK(msh_pk_is_str(msh_pk_item(l, n + 6), "h\xc3\xa9"));
    const struct msh_pk *t = msh_pk_item(l, n + 7);
    int64_t a = -1, b = -1;
    CHECK(t->kind == MSH_PK_TUPLE && msh_pk_len(t) == 2 && msh_pk_get_i64(msh_pk_item(t, 0), &a) == 0 && a == 0 &&
          msh_pk_get_i64(msh_pk_item(t, 1), &b) == 0 && b == 7);
    msh_pk_free(doc);
    pkw_free(&w);
}

/* Containers past the 1000-item batch, nested, and 300 memoized strings (BINGET then LONG_BINGET). */
TEST(pickle_batches_and_memo)
{
    struct pkw w;
    pkw_init(&w);
    pkw_begin(&w);
    pkw_dict(&w);
    pkw_str(&w, "big");
    pkw_list(&w);
    for (int i = 0; i < 2500; i++) pkw_int(&w, i);
    pkw_close(&w);
    pkw_str(&w, "map");
    pkw_dict(&w);
    uint32_t slots[300] = {0};
    char key[32];
    for (int i = 0; i < 1200; i++) {
        snprintf(key, sizeof key, "k%d", i);
        pkw_str(&w, key);
        snprintf(key, sizeof key, "v%d", i % 300);
        pkw_str_memo(&w, key, &slots[i % 300]);
    }
    pkw_close(&w);
    pkw_close(&w);
    pkw_end(&w);
    REQUIRE(w.err == 0);
    CHECK(w.memo == 300);
    struct msh_pk_doc *doc = parse(&w);
    REQUIRE(doc);
    const struct msh_pk *r = msh_pk_root(doc);
    const struct msh_pk *big = msh_pk_dict_get(r, "big");
    REQUIRE(big && msh_pk_len(big) == 2500);
    int64_t v = -1;
    CHECK(msh_pk_get_i64(msh_pk_item(big, 2499), &v) == 0 && v == 2499);
    const struct msh_pk *m = msh_pk_dict_get(r, "map");
    REQUIRE(m && msh_pk_len(m) == 1200);
    CHECK(msh_pk_is_str(msh_pk_dict_get(m, "k1199"), "v299"));
    CHECK(msh_pk_is_str(msh_pk_dict_get(m, "k900"), "v0"));
    msh_pk_free(doc);
    pkw_free(&w);
}

static const struct msh_pk *events_of(const struct msh_pk *root)
{
    return msh_pk_item(msh_pk_dict_get(root, "device_traces"), 0);
}

static bool action_is(const struct msh_pk *e, const char *a)
{
    return msh_pk_is_str(msh_pk_dict_get(e, "action"), a);
}

static uint64_t field(const struct msh_pk *d, const char *k)
{
    uint64_t v = 0;
    msh_pk_get_u64(msh_pk_dict_get(d, k), &v);
    return v;
}

TEST(snapshot_window_starts_where_the_viewer_can_replay)
{
    REQUIRE(memshim_history_record(2, 1000, 1, 0) == 0);
    void *x = memshim_malloc(3 * MiB, 0, NULL);
    REQUIRE(x);
    struct msh_pool *pool = msh_core_pool_get(0);
    REQUIRE(pool);
    /* In the pool (its pages mapped, the map events recorded) but with no alloc event yet. (30 MiB:
     * with no limit the pool maps the open end of its VA line in 20 MiB chunks, so a smaller block
     * right after x could find its pages mapped already, with no map event of its own.) */
    uint64_t y = 0;
    REQUIRE(msh_pool_alloc(pool, 30 * MiB, 0, &y) == 0);
    void *z = memshim_malloc(7 * MiB, 0, NULL);
    REQUIRE(z);
    unsigned char *buf = NULL;
    size_t len = 0;
    REQUIRE(memshim_snapshot(&buf, &len) == 0);
    struct pkw w = {.buf = buf, .len = len};
    struct msh_pk_doc *doc = parse(&w);
    REQUIRE(doc);
    const struct msh_pk *ev = events_of(msh_pk_root(doc));
    REQUIRE(ev);
    bool y_map = false, x_alloc = false, z_alloc = false;
    for (size_t i = 0; i < msh_pk_len(ev); i++) {
        const struct msh_pk *e = msh_pk_item(ev, i);
        uint64_t a = field(e, "addr"), s = field(e, "size");
        if (action_is(e, "segment_map") && a < y + 30 * MiB && a + s > y) y_map = true;
        if (action_is(e, "alloc") && a == (uint64_t)(uintptr_t)x) x_alloc = true;
        if (action_is(e, "alloc") && a == (uint64_t)(uintptr_t)z) z_alloc = true;
    }
    CHECKF(!y_map, "a map of the untracked block's pages is in the window: the viewer would lose the block");
    CHECK(!x_alloc);  /* older than that map: dropped with it */
    CHECK(z_alloc);   /* newer: kept */
    /* y is still in the state: an active block of 30 MiB */
    const struct msh_pk *segs = msh_pk_dict_get(msh_pk_root(doc), "segments");
    bool y_live = false;
    for (size_t i = 0; i < msh_pk_len(segs); i++) {
        const struct msh_pk *bl = msh_pk_dict_get(msh_pk_item(segs, i), "blocks");
        for (size_t j = 0; j < msh_pk_len(bl); j++) {
            const struct msh_pk *b = msh_pk_item(bl, j);
            if (field(b, "address") == y && msh_pk_is_str(msh_pk_dict_get(b, "state"), "active_allocated") &&
                field(b, "requested_size") == 30 * MiB)
                y_live = true;
        }
    }
    CHECK(y_live);
    msh_pk_free(doc);
    memshim_snapshot_free(buf);
    msh_pool_free(pool, y, MSH_STREAM_COMPLETED);
    memshim_free(x, 3 * MiB, 0, NULL);
    memshim_free(z, 7 * MiB, 0, NULL);
    REQUIRE(memshim_history_record(0, 0, 0, 0) == 0);
}

TEST(snapshot_state_only_mode_keeps_no_events)
{
    REQUIRE(memshim_history_record(1, 0, 0, 1) == 0);
    void *x = memshim_malloc(MiB, 0, NULL);
    REQUIRE(x);
    unsigned char *buf = NULL;
    size_t len = 0;
    REQUIRE(memshim_snapshot(&buf, &len) == 0);
    struct pkw w = {.buf = buf, .len = len};
    struct msh_pk_doc *doc = parse(&w);
    REQUIRE(doc);
    CHECK(msh_pk_len(events_of(msh_pk_root(doc))) == 0);
    CHECK(msh_pk_len(msh_pk_dict_get(msh_pk_root(doc), "segments")) >= 1);
    msh_pk_free(doc);
    memshim_snapshot_free(buf);
    memshim_free(x, MiB, 0, NULL);
    CHECK(memshim_history_record(3, 0, 0, 0) == EINVAL);
    REQUIRE(memshim_history_record(0, 0, 0, 0) == 0);
}

/* 600 mapped ranges, made through the device the history wraps (one map call per page, as the
 * pool makes under a limit): the history's table of maps (open addressing, 1024 slots at first,
 * doubled at half full) holds every one, slots that collide included (600 ranges cannot all miss
 * each other), and forgets each at its unmap. */
TEST(history_keeps_every_map_when_table_slots_collide)
{
    REQUIRE(memshim_history_record(2, 1000, 1, 0) == 0);
    void *first = memshim_malloc(MiB, 0, NULL); /* the device is set up and wrapped */
    REQUIRE(first);
    struct msh_device *d = msh_core_device(0);
    REQUIRE(d && d->ops->reserve && d->ops->map);
    enum { N = 600 };
    size_t gran = 2 * MiB;
    uint64_t va = 0, h[N];
    REQUIRE(d->ops->reserve(d, N * gran, gran, &va) == 0);
    size_t nev = 0, nmap0 = 0, nres = 0, nmap = 0;
    msh_history_sizes(0, &nev, &nmap0, &nres);
    int made = 0;
    for (; made < N; made++) {
        if (d->ops->create(d, gran, &h[made])) break;
        if (d->ops->map(d, va + made * gran, gran, h[made])) {
            d->ops->release(d, h[made], gran);
            break;
        }
    }
    CHECK(made == N);
    msh_history_sizes(0, &nev, &nmap, &nres);
    CHECKF(nmap == nmap0 + (size_t)made, "%zu mapped ranges recorded, %zu before and %d maps since", nmap, nmap0, made);
    for (int i = 0; i < made; i++) {
        CHECK(d->ops->unmap(d, va + i * gran, gran) == 0);
        CHECK(d->ops->release(d, h[i], gran) == 0);
    }
    msh_history_sizes(0, &nev, &nmap, &nres);
    CHECKF(nmap == nmap0, "%zu mapped ranges after every unmap, %zu before", nmap, nmap0);
    CHECK(d->ops->unreserve(d, va, N * gran) == 0);
    memshim_free(first, MiB, 0, NULL);
    REQUIRE(memshim_history_record(0, 0, 0, 0) == 0);
}

TEST_MAIN()
