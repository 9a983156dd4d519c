/*
 * test_pool.c: the defragmenting pool (policy/pool/) over the simulated device and over a
 * recording fake device defined here.
 *
 * The fake device (struct fake) implements struct msh_device_ops, logs every call in order (so
 * tests can check that a synchronize precedes an unmap, or that an event is recorded on the old
 * stream before the new stream waits on it), can fail the N-th create/map/unmap, can run out of
 * physical memory at a chosen capacity, and counts live handles, mappings, reservations and
 * events so that a test can prove nothing leaked after msh_pool_destroy. It also checks device
 * misuse the real driver would reject (mapping over a mapping, unmapping what is not mapped,
 * releasing a handle still mapped, freeing a reservation with mappings) and counts it in
 * `misuse`, which every test expects to stay 0.
 */
#include "harness.h"
#include "msh.h"
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MiB MSH_MiB
#define GiB MSH_GiB
#define GRAN (2 * MiB)

/* Every pool call in this file is followed by msh_pool_check() (issue 12): a structural bug
 * anywhere in the pool fails the test that triggered it, at the line of the call. The macros
 * shadow the functions; (name)(...) calls the real one. */
static void pool_checked(struct msh_pool *p, const char *call, const char *file, int line)
{
    char why[512];
    if (p && msh_pool_check(p, why, sizeof why)) {
        th_failed_now++;
        fprintf(stderr, "    %s:%d: after %s: pool invariant broken: %s\n", file, line, call, why);
    }
}
#define msh_pool_alloc(p, s, st, a) \
    __extension__({ int r_ = (msh_pool_alloc)(p, s, st, a); pool_checked(p, "msh_pool_alloc", __FILE__, __LINE__); r_; })
#define msh_pool_free(p, a, st) \
    __extension__({ int r_ = (msh_pool_free)(p, a, st); pool_checked(p, "msh_pool_free", __FILE__, __LINE__); r_; })
#define msh_pool_record_stream(p, a, st) \
    __extension__({ int r_ = (msh_pool_record_stream)(p, a, st); pool_checked(p, "msh_pool_record_stream", __FILE__, __LINE__); r_; })
#define msh_pool_empty_cache(p) \
    __extension__({ size_t r_ = (msh_pool_empty_cache)(p); pool_checked(p, "msh_pool_empty_cache", __FILE__, __LINE__); r_; })
#define msh_pool_reset_peaks(p) \
    __extension__({ (msh_pool_reset_peaks)(p); pool_checked(p, "msh_pool_reset_peaks", __FILE__, __LINE__); })

/* ---- the recording fake device ---------------------------------------------------------------- */

enum fk_op { OP_CREATE, OP_RELEASE, OP_MAP, OP_UNMAP, OP_SYNC, OP_EVREC, OP_EVREL, OP_EVQUERY,
             OP_WAIT, OP_RESERVE, OP_UNRESERVE, OP_ACCESS, OP_EVCREATE, OP_N };
static const char fk_code[OP_N] = {'C', 'R', 'M', 'U', 'S', 'E', 'e', 'q', 'W', 'V', 'v', 'A', 'c'};

#define FK_MAX 8192
#define FK_LOG 65536

struct fk_entry { char op; uint64_t a, b; };

struct fake {
    struct msh_device dev;
    size_t gran, capacity; /* capacity: bytes of handles the device can hold (0: unlimited) */
    uint64_t next_va, next_handle, next_event;
    long live_handles, live_maps, live_resv, live_events, misuse;
    size_t live_bytes;     /* bytes of live handles */
    long calls[OP_N];
    size_t bytes[OP_N];  /* bytes covered by create/release/map/unmap/set_access calls */
    long fail_at[OP_N]; /* fail the call whose number (1-based, counted from arming) is this */
    long armed_base[OP_N];
    int fail_err[OP_N];
    long failures;
    struct { uint64_t h; size_t size; } handles[FK_MAX];
    int nhandles;
    struct { uint64_t va, h; size_t size; bool access; } maps[FK_MAX];
    int nmaps;
    struct { uint64_t va, size; } resv[64];
    int nresv;
    struct fk_entry log[FK_LOG];
    int nlog;
    bool ev_busy; /* events are not complete yet: queries answer EBUSY */
    struct msh_pool *probe; /* fake_ops_home: the pool checked while it waits for stream_home */
    /* the next event record frees this block on this stream first (another thread's free, made
     * while the pool has its lock dropped for the record) */
    struct msh_pool *rec_free_pool;
    uint64_t rec_free_addr, rec_free_stream;
    size_t peak_bytes;                /* the most live_bytes has been */
    void (*on_release)(struct fake *); /* called once, first thing in the next release */
    int probe_bad;
    char probe_why[256];
};

static struct fake *FK(struct msh_device *d) { return d->impl; }

static void fk_log(struct fake *f, enum fk_op op, uint64_t a, uint64_t b)
{
    if (f->nlog < FK_LOG) f->log[f->nlog++] = (struct fk_entry){fk_code[op], a, b};
}

/* Count the call; returns an injected error or 0. */
static int fk_enter(struct fake *f, enum fk_op op)
{
    f->calls[op]++;
    if (f->fail_at[op] && f->calls[op] - f->armed_base[op] == f->fail_at[op]) {
        f->failures++;
        return f->fail_err[op];
    }
    return 0;
}

/* The mapping containing va, or -1. */
static int fk_find_map(struct fake *f, uint64_t va)
{
    for (int i = 0; i < f->nmaps; i++)
        if (va >= f->maps[i].va && va < f->maps[i].va + f->maps[i].size) return i;
    return -1;
}

static int fk_find_handle(struct fake *f, uint64_t h)
{
    for (int i = 0; i < f->nhandles; i++)
        if (f->handles[i].h == h) return i;
    return -1;
}

static int fk_mem_info(struct msh_device *d, size_t *fr, size_t *tot)
{
    struct fake *f = FK(d);
    size_t cap = f->capacity ? f->capacity : 64 * GiB;
    *tot = cap;
    *fr = cap - f->live_bytes;
    return 0;
}

static int fk_granularity(struct msh_device *d, size_t *g)
{
    *g = FK(d)->gran;
    return 0;
}

static int fk_reserve(struct msh_device *d, size_t size, size_t align, uint64_t *va)
{
    struct fake *f = FK(d);
    fk_log(f, OP_RESERVE, size, 0);
    if (!size || size % f->gran || f->nresv == 64) return EINVAL;
    if (align < f->gran) align = f->gran;
    uint64_t a = (f->next_va + align - 1) / align * align;
    f->next_va = a + size + f->gran;
    f->resv[f->nresv].va = a;
    f->resv[f->nresv].size = size;
    f->nresv++;
    f->live_resv++;
    *va = a;
    return 0;
}

static int fk_unreserve(struct msh_device *d, uint64_t va, size_t size)
{
    struct fake *f = FK(d);
    fk_log(f, OP_UNRESERVE, va, size);
    for (int i = 0; i < f->nmaps; i++)
        if (f->maps[i].va >= va && f->maps[i].va < va + size) f->misuse++; /* still mapped */
    for (int i = 0; i < f->nresv; i++) {
        if (f->resv[i].va == va && f->resv[i].size == size) {
            f->resv[i] = f->resv[--f->nresv];
            f->live_resv--;
            return 0;
        }
    }
    f->misuse++;
    return EINVAL;
}

static int fk_create(struct msh_device *d, size_t size, uint64_t *h)
{
    struct fake *f = FK(d);
    int rc = fk_enter(f, OP_CREATE);
    fk_log(f, OP_CREATE, size, rc);
    f->bytes[OP_CREATE] += size;
    if (rc) return rc;
    if (!size || size % f->gran) {
        f->misuse++;
        return EINVAL;
    }
    if (f->capacity && f->live_bytes + size > f->capacity) return ENOMEM;
    if (f->nhandles == FK_MAX) return ENOMEM;
    *h = ++f->next_handle;
    f->handles[f->nhandles].h = *h;
    f->handles[f->nhandles++].size = size;
    f->live_handles++;
    f->live_bytes += size;
    if (f->live_bytes > f->peak_bytes) f->peak_bytes = f->live_bytes;
    return 0;
}

static int fk_release(struct msh_device *d, uint64_t h, size_t size)
{
    struct fake *f = FK(d);
    if (f->on_release) {
        void (*fn)(struct fake *) = f->on_release;
        f->on_release = NULL;
        fn(f);
    }
    int rc = fk_enter(f, OP_RELEASE);
    fk_log(f, OP_RELEASE, h, size);
    f->bytes[OP_RELEASE] += size;
    if (rc) return rc; /* refused: the handle stays (the pool keeps it as an orphan) */
    int i = fk_find_handle(f, h);
    if (i < 0 || f->handles[i].size != size) {
        f->misuse++;
        return EINVAL;
    }
    for (int k = 0; k < f->nmaps; k++)
        if (f->maps[k].h == h) f->misuse++; /* the pool never releases a mapped handle */
    f->live_bytes -= f->handles[i].size;
    f->handles[i] = f->handles[--f->nhandles];
    f->live_handles--;
    return 0;
}

/* The driver's rules: the whole handle, at a granularity-aligned address, over nothing mapped,
 * and a handle mapped at one place only (two places would alias). */
static int fk_map(struct msh_device *d, uint64_t va, size_t size, uint64_t h)
{
    struct fake *f = FK(d);
    int rc = fk_enter(f, OP_MAP);
    fk_log(f, OP_MAP, va, h);
    f->bytes[OP_MAP] += size;
    if (rc) return rc;
    int hi = fk_find_handle(f, h);
    if (hi < 0 || size != f->handles[hi].size || va % f->gran) {
        f->misuse++;
        return EINVAL;
    }
    for (int k = 0; k < f->nmaps; k++)
        if (f->maps[k].h == h || (f->maps[k].va < va + size && va < f->maps[k].va + f->maps[k].size)) {
            f->misuse++;
            return EINVAL;
        }
    if (f->nmaps == FK_MAX) return ENOMEM;
    f->maps[f->nmaps].va = va;
    f->maps[f->nmaps].h = h;
    f->maps[f->nmaps].size = size;
    f->maps[f->nmaps].access = false;
    f->nmaps++;
    f->live_maps++;
    return 0;
}

/* Every byte of the range must be mapped (it may span several mappings). */
static int fk_set_access(struct msh_device *d, uint64_t va, size_t size)
{
    struct fake *f = FK(d);
    int rc = fk_enter(f, OP_ACCESS);
    fk_log(f, OP_ACCESS, va, size);
    f->bytes[OP_ACCESS] += size;
    if (rc) return rc;
    for (uint64_t a = va; a < va + size;) {
        int i = fk_find_map(f, a);
        if (i < 0) {
            f->misuse++;
            return EINVAL;
        }
        a = f->maps[i].va + f->maps[i].size;
    }
    for (int i = 0; i < f->nmaps; i++)
        if (f->maps[i].va >= va && f->maps[i].va < va + size) f->maps[i].access = true;
    return 0;
}

/* Whole mappings only: the range starts at a mapping, ends at one's end, with no gap. */
static int fk_unmap(struct msh_device *d, uint64_t va, size_t size)
{
    struct fake *f = FK(d);
    int rc = fk_enter(f, OP_UNMAP);
    fk_log(f, OP_UNMAP, va, size);
    f->bytes[OP_UNMAP] += size;
    if (rc) return rc;
    for (uint64_t a = va; a < va + size;) {
        int i = fk_find_map(f, a);
        if (i < 0 || f->maps[i].va != a || f->maps[i].va + f->maps[i].size > va + size) {
            f->misuse++;
            return EINVAL;
        }
        a = f->maps[i].va + f->maps[i].size;
    }
    for (int i = 0; i < f->nmaps;) {
        if (f->maps[i].va >= va && f->maps[i].va < va + size) {
            f->maps[i] = f->maps[--f->nmaps];
            f->live_maps--;
        } else {
            i++;
        }
    }
    return 0;
}

static int fk_event_create(struct msh_device *d, uint64_t *ev)
{
    struct fake *f = FK(d);
    int rc = fk_enter(f, OP_EVCREATE);
    *ev = ++f->next_event;
    fk_log(f, OP_EVCREATE, *ev, 0);
    if (rc) return rc;
    f->live_events++;
    return 0;
}

static int fk_event_record(struct msh_device *d, uint64_t ev, uint64_t stream)
{
    struct fake *f = FK(d);
    int rc = fk_enter(f, OP_EVREC);
    fk_log(f, OP_EVREC, stream, ev);
    if (!ev || ev > f->next_event) f->misuse++;
    struct msh_pool *p = f->rec_free_pool;
    if (p) {
        f->rec_free_pool = NULL;
        if (msh_pool_free(p, f->rec_free_addr, f->rec_free_stream)) f->misuse++;
    }
    return rc;
}

static int fk_event_query(struct msh_device *d, uint64_t ev)
{
    fk_enter(FK(d), OP_EVQUERY);
    fk_log(FK(d), OP_EVQUERY, ev, 0);
    return FK(d)->ev_busy ? EBUSY : 0;
}

static int fk_event_release(struct msh_device *d, uint64_t ev)
{
    struct fake *f = FK(d);
    fk_enter(f, OP_EVREL);
    fk_log(f, OP_EVREL, ev, 0);
    f->live_events--;
    return 0;
}

static int fk_stream_wait(struct msh_device *d, uint64_t stream, uint64_t ev)
{
    struct fake *f = FK(d);
    int rc = fk_enter(f, OP_WAIT);
    fk_log(f, OP_WAIT, stream, ev);
    return rc;
}

static int fk_synchronize(struct msh_device *d)
{
    struct fake *f = FK(d);
    int rc = fk_enter(f, OP_SYNC);
    fk_log(f, OP_SYNC, 0, 0);
    return rc;
}

static const struct msh_device_ops fake_ops = {
    .name = "fake",
    .mem_info = fk_mem_info,
    .granularity = fk_granularity,
    .reserve = fk_reserve,
    .unreserve = fk_unreserve,
    .create = fk_create,
    .release = fk_release,
    .map = fk_map,
    .set_access = fk_set_access,
    .unmap = fk_unmap,
    .event_create = fk_event_create,
    .event_record = fk_event_record,
    .event_query = fk_event_query,
    .event_release = fk_event_release,
    .stream_wait = fk_stream_wait,
    .synchronize = fk_synchronize,
};

/* A stream's context is asked for with the pool's lock dropped: the pool must be consistent then
 * (another thread may check it, look a block up, or free). */
static int fk_stream_home(struct msh_device *d, uint64_t stream __attribute__((unused)), uint64_t *home)
{
    struct fake *f = FK(d);
    if (f->probe && (msh_pool_check)(f->probe, f->probe_why, sizeof f->probe_why)) f->probe_bad++;
    *home = 0;
    return 0;
}

static struct msh_device_ops fake_ops_home;

static struct fake *fake_new(size_t capacity, uint64_t base)
{
    struct fake *f = calloc(1, sizeof *f);
    if (!f) abort();
    f->gran = GRAN;
    f->capacity = capacity;
    f->next_va = base ? base : (uint64_t)1 << 44;
    f->dev.ops = &fake_ops;
    f->dev.impl = f;
    return f;
}

/* Fail the n-th call of op counted from now (n = 0: disarm). */
static void fake_fail_nth(struct fake *f, enum fk_op op, long n, int err)
{
    f->fail_at[op] = n;
    f->armed_base[op] = f->calls[op];
    f->fail_err[op] = err;
}

static void fake_log_clear(struct fake *f) { f->nlog = 0; }

static int fake_log_count(const struct fake *f, char op)
{
    int n = 0;
    for (int i = 0; i < f->nlog; i++) n += f->log[i].op == op;
    return n;
}

/* Index of the first entry `op` in the log at or after `from`, or -1. */
static int fake_log_find(const struct fake *f, char op, int from)
{
    for (int i = from; i < f->nlog; i++)
        if (f->log[i].op == op) return i;
    return -1;
}

static size_t fake_mapped_bytes(const struct fake *f)
{
    size_t n = 0;
    for (int i = 0; i < f->nmaps; i++) n += f->maps[i].size;
    return n;
}

/* The page at page_va is mapped, with access granted. */
static bool fake_is_mapped(struct fake *f, uint64_t page_va)
{
    int i = fk_find_map(f, page_va);
    return i >= 0 && f->maps[i].access;
}

/* ---- helpers ------------------------------------------------------------------------------------ */

__attribute__((constructor)) static void quiet(void)
{
    msh_log_level = getenv("TDEBUG") ? MSH_LOG_DEBUG : MSH_LOG_ERROR; /* OOM warnings are expected in these tests */
    alarm(600);                    /* a deadlock (GC callback under the lock) must not hang CI */
}

/* A pool that maps exactly the pages live blocks touch (no chunk mapped ahead at the open end of
 * the line: tests of that use their own parameters). */
static struct msh_pool *mk_pool(struct msh_device *d, size_t limit, bool defrag, size_t small_max)
{
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.ahead_bytes = GRAN;
    p.limit_bytes = limit;
    p.defrag = defrag;
    p.plan_sync = true; /* the learned step is packed and used at the boundary where it was found,
                         * as in the replay (test_pool_threads.c tests the planner thread) */
    if (small_max) p.small_max = small_max;
    p.va_bytes = 8 * GiB;
    struct msh_pool *pool = NULL;
    if (msh_pool_create(d, &p, &pool)) return NULL;
    return pool;
}

static struct msh_pool_stats stats(struct msh_pool *pool)
{
    struct msh_pool_stats s;
    msh_pool_get_stats(pool, &s);
    return s;
}

static uint32_t rng_next(uint32_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

/* Live blocks of a pool, gathered with msh_pool_for_each_live. */
struct live_set { uint64_t addr[4096]; size_t size[4096]; int n; };

static void live_cb(void *arg, uint64_t addr, size_t size, uint64_t stream __attribute__((unused)))
{
    struct live_set *ls = arg;
    if (ls->n < 4096) {
        ls->addr[ls->n] = addr;
        ls->size[ls->n] = size;
        ls->n++;
    }
}

/* No two live blocks overlap (size 0 counts as one byte). Returns the number of overlaps. */
static int overlaps(struct msh_pool *pool, int *count)
{
    static struct live_set ls;
    ls.n = 0;
    msh_pool_for_each_live(pool, live_cb, &ls);
    if (count) *count = ls.n;
    int bad = 0;
    for (int i = 0; i < ls.n; i++)
        for (int j = i + 1; j < ls.n; j++) {
            uint64_t ea = ls.addr[i] + (ls.size[i] ? ls.size[i] : 1);
            uint64_t eb = ls.addr[j] + (ls.size[j] ? ls.size[j] : 1);
            if (ls.addr[i] < eb && ls.addr[j] < ea) bad++;
        }
    return bad;
}

/* ---- addresses and sizes ------------------------------------------------------------------------ */

TEST(alignment_and_sizes_1_byte_to_1_GiB)
{
    struct msh_device d;
    REQUIRE(msh_dev_sim_init(&d, 16 * GiB, GRAN) == 0);
    struct msh_pool *pool = mk_pool(&d, 0, true, 0);
    REQUIRE(pool);
    static const size_t sizes[] = {1, 2, 3, 511, 512, 513, 1000, 4095, 4096, 65535, 65537,
                                   MiB - 1, MiB, MiB + 1, 2 * MiB - 1, 2 * MiB, 2 * MiB + 1,
                                   3 * MiB, 7 * MiB + 3, 100 * MiB + 17, 512 * MiB, GiB};
    enum { N = sizeof sizes / sizeof sizes[0] };
    uint64_t a[N];
    size_t total = 0;
    for (int i = 0; i < N; i++) {
        REQUIRE(msh_pool_alloc(pool, sizes[i], 7, &a[i]) == 0);
        CHECKF(a[i] % 512 == 0, "size %zu at %#llx", sizes[i], (unsigned long long)a[i]);
        CHECK(a[i] != 0);
        CHECK(msh_pool_block_size(pool, a[i]) == sizes[i]);
        CHECK(msh_pool_owns(pool, a[i]));
        total += sizes[i];
    }
    CHECK(overlaps(pool, NULL) == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.live_bytes == total);
    CHECK(s.live_blocks == N);
    CHECK(s.mapped_bytes >= total);
    CHECK(s.mapped_bytes <= total + 2 * N * GRAN);
    /* every size, with odd neighbours, again interleaved: still aligned and disjoint */
    uint32_t r = 12345;
    uint64_t b[200];
    for (int i = 0; i < 200; i++) {
        size_t sz = 1 + rng_next(&r) % (3 * MiB);
        REQUIRE(msh_pool_alloc(pool, sz, 7, &b[i]) == 0);
        CHECK(b[i] % 512 == 0);
    }
    CHECK(overlaps(pool, NULL) == 0);
    for (int i = 0; i < 200; i++) CHECK(msh_pool_free(pool, b[i], 7) == 0);
    for (int i = 0; i < N; i++) CHECK(msh_pool_free(pool, a[i], 7) == 0);
    s = stats(pool);
    CHECK(s.live_bytes == 0 && s.live_blocks == 0 && s.touched_bytes == 0);
    /* absurd sizes */
    uint64_t x = 0;
    CHECK(msh_pool_alloc(pool, SIZE_MAX, 7, &x) == EINVAL);
    CHECK(msh_pool_alloc(pool, ((size_t)1 << 48) + 1, 7, &x) == EINVAL);
    msh_pool_destroy(pool);
    msh_dev_sim_fini(&d);
}

/* memshim-replay's device (--capacity): as full as the driver would say, never more free than there
 * is; a full device has 0 bytes free, and refuses the next page. */
TEST(simulated_device_reports_what_is_free_up_to_full)
{
    struct msh_device d;
    REQUIRE(msh_dev_sim_init(&d, 4 * GRAN, GRAN) == 0);
    size_t fr = 1, tot = 0;
    uint64_t h[5];
    CHECK(d.ops->mem_info(&d, &fr, &tot) == 0 && fr == 4 * GRAN && tot == 4 * GRAN);
    for (int i = 0; i < 4; i++) REQUIRE(d.ops->create(&d, GRAN, &h[i]) == 0);
    CHECK(d.ops->mem_info(&d, &fr, &tot) == 0);
    CHECKF(fr == 0 && tot == 4 * GRAN, "full device: %zu free of %zu", fr, tot);
    CHECK(d.ops->create(&d, GRAN, &h[4]) != 0);
    REQUIRE(d.ops->release(&d, h[0], GRAN) == 0);
    CHECK(d.ops->mem_info(&d, &fr, &tot) == 0 && fr == GRAN);
    for (int i = 1; i < 4; i++) d.ops->release(&d, h[i], GRAN);
    msh_dev_sim_fini(&d);
}

TEST(size_zero_gives_distinct_blocks)
{
    struct msh_device d;
    REQUIRE(msh_dev_sim_init(&d, 0, GRAN) == 0);
    struct msh_pool *pool = mk_pool(&d, 0, true, 0);
    REQUIRE(pool);
    uint64_t a = 0, b = 0, c = 0;
    REQUIRE(msh_pool_alloc(pool, 0, 1, &a) == 0);
    REQUIRE(msh_pool_alloc(pool, 0, 1, &b) == 0);
    REQUIRE(msh_pool_alloc(pool, 1, 1, &c) == 0);
    CHECK(a && b && a != b && c != a && c != b);
    CHECK(a % 512 == 0 && b % 512 == 0);
    CHECK(msh_pool_owns(pool, a) && msh_pool_owns(pool, b));
    CHECK(msh_pool_block_size(pool, a) == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.live_blocks == 3 && s.live_bytes == 1);
    CHECK(s.hist[0] == 3); /* 0, 0 and 1 byte: the first bucket */
    CHECK(msh_pool_free(pool, a, 1) == 0);
    CHECK(msh_pool_free(pool, b, 1) == 0);
    CHECK(msh_pool_free(pool, c, 1) == 0);
    CHECK(stats(pool).live_blocks == 0);
    msh_pool_destroy(pool);
    msh_dev_sim_fini(&d);
}

TEST(free_of_unknown_address_is_einval_and_changes_nothing)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a = 0, b = 0;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 1, &a) == 0);
    REQUIRE(msh_pool_alloc(pool, 1000, 1, &b) == 0);
    REQUIRE(msh_pool_free(pool, b, 1) == 0);
    struct msh_pool_stats before = stats(pool);
    int nlog = f->nlog;
    CHECK(msh_pool_free(pool, 0, 1) == EINVAL);
    CHECK(msh_pool_free(pool, a + 512, 1) == EINVAL);  /* inside a live block */
    CHECK(msh_pool_free(pool, a - 512, 1) == EINVAL);
    CHECK(msh_pool_free(pool, b, 1) == EINVAL);        /* double free */
    CHECK(msh_pool_free(pool, 0xdeadbeef000ull, MSH_STREAM_COMPLETED) == EINVAL);
    CHECK(msh_pool_record_stream(pool, b, 2) == EINVAL);
    CHECK(msh_pool_block_size(pool, b) == 0);
    CHECK(!msh_pool_owns(pool, b));
    struct msh_pool_stats after = stats(pool);
    CHECK(memcmp(&before, &after, sizeof before) == 0);
    CHECK(f->nlog == nlog); /* no device call either */
    CHECK(msh_pool_block_size(pool, a) == 3 * MiB);
    CHECK(msh_pool_free(pool, a, 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->live_resv == 0 && f->misuse == 0);
    free(f);
}

/* ---- placement ------------------------------------------------------------------------------------ */

TEST(coalescing_frees_make_one_extent_reused_without_maps)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    const size_t sa = 3 * MiB + 512, sb = 5 * MiB - 1024, sc = 2 * MiB + 4096;
    uint64_t a, b, c, d;
    REQUIRE(msh_pool_alloc(pool, sa, 1, &a) == 0);
    REQUIRE(msh_pool_alloc(pool, sb, 1, &b) == 0);
    REQUIRE(msh_pool_alloc(pool, sc, 1, &c) == 0);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 1, &d) == 0); /* bounds the hole */
    CHECK(b == a + sa && c == b + sb && d == c + sc);    /* packed along the line */
    CHECK(msh_pool_free(pool, b, 1) == 0);
    CHECK(msh_pool_free(pool, a, 1) == 0);
    CHECK(msh_pool_free(pool, c, 1) == 0);
    struct msh_pool_stats s0 = stats(pool);
    CHECK(s0.largest_free >= sa + sb + sc);
    uint64_t e;
    REQUIRE(msh_pool_alloc(pool, sa + sb + sc, 1, &e) == 0);
    CHECK(e == a);
    struct msh_pool_stats s1 = stats(pool);
    CHECK(s1.map_ops == s0.map_ops && s1.create_ops == s0.create_ops && s1.unmap_ops == s0.unmap_ops);
    CHECK(msh_pool_free(pool, e, 1) == 0);
    CHECK(msh_pool_free(pool, d, 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(small_requests_never_share_a_page_with_large_ones)
{
    struct msh_device d;
    REQUIRE(msh_dev_sim_init(&d, 0, GRAN) == 0);
    struct msh_pool *pool = mk_pool(&d, 0, true, MiB);
    REQUIRE(pool);
    uint64_t sm[300], lg[40];
    size_t ssz[300], lsz[40];
    uint32_t r = 99;
    for (int i = 0, j = 0, k = 0; i < 340; i++) {
        if (i % 8 == 7 && k < 40) {
            lsz[k] = MiB + 1 + rng_next(&r) % (9 * MiB);
            REQUIRE(msh_pool_alloc(pool, lsz[k], 1, &lg[k]) == 0);
            k++;
        } else if (j < 300) {
            ssz[j] = 1 + rng_next(&r) % MiB; /* up to small_max inclusive */
            if (j == 0) ssz[j] = MiB;
            REQUIRE(msh_pool_alloc(pool, ssz[j], 1, &sm[j]) == 0);
            j++;
        }
    }
    int shared = 0;
    for (int j = 0; j < 300; j++)
        for (int k = 0; k < 40; k++) {
            uint64_t s0 = sm[j] / GRAN, s1 = (sm[j] + ssz[j] - 1) / GRAN;
            uint64_t l0 = lg[k] / GRAN, l1 = (lg[k] + lsz[k] - 1) / GRAN;
            if (s0 <= l1 && l0 <= s1) shared++;
        }
    CHECK(shared == 0);
    CHECK(overlaps(pool, NULL) == 0);
    msh_pool_destroy(pool);
    msh_dev_sim_fini(&d);
}

TEST(live_bytes_peak_and_counters)
{
    struct msh_device d;
    REQUIRE(msh_dev_sim_init(&d, 0, GRAN) == 0);
    struct msh_pool *pool = mk_pool(&d, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, b, c;
    REQUIRE(msh_pool_alloc(pool, 1000, 1, &a) == 0);
    REQUIRE(msh_pool_alloc(pool, 5 * MiB, 1, &b) == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.live_bytes == 1000 + 5 * MiB && s.peak_live_bytes == s.live_bytes && s.live_blocks == 2);
    CHECK(s.allocs == 2 && s.frees == 0);
    CHECK(msh_pool_free(pool, b, 1) == 0);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &c) == 0);
    s = stats(pool);
    CHECK(s.live_bytes == 1000 + 2 * MiB);
    CHECK(s.peak_live_bytes == 1000 + 5 * MiB);
    CHECK(s.allocs == 3 && s.frees == 1 && s.live_blocks == 2);
    CHECK(s.peak_mapped_bytes >= s.mapped_bytes);
    CHECK(s.peak_touched_bytes >= 4 * GRAN); /* 1000 B page + three 5 MiB pages */
    msh_pool_reset_peaks(pool);
    s = stats(pool);
    CHECK(s.peak_live_bytes == s.live_bytes);
    CHECK(s.peak_mapped_bytes == s.mapped_bytes);
    CHECK(s.peak_touched_bytes == s.touched_bytes);
    CHECK(msh_pool_free(pool, a, 1) == 0);
    CHECK(msh_pool_free(pool, c, 1) == 0);
    s = stats(pool);
    CHECK(s.live_bytes == 0 && s.live_blocks == 0 && s.frees == 3 && s.touched_bytes == 0);
    CHECK(s.peak_live_bytes == 1000 + 2 * MiB);
    /* histogram: 1000 B in [512,1024) = bucket 1; 5 MiB in bucket 14; 2 MiB in bucket 13 */
    CHECK(s.hist[1] == 1 && s.hist[14] == 1 && s.hist[13] == 1);
    msh_pool_destroy(pool);
    msh_dev_sim_fini(&d);
}

TEST(pages_are_mapped_only_where_live_blocks_touch)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 1, &a) == 0);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 1, &b) == 0);
    CHECK(b == a + 3 * MiB);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.map_ops == 3 && s.create_ops == 3); /* 6 MiB over pages 0,1,2: not 4 */
    CHECK(s.mapped_bytes == 3 * GRAN && s.touched_bytes == 3 * GRAN);
    CHECK(f->live_maps == 3 && f->live_handles == 3);
    /* every byte handed out is mapped on the device */
    for (uint64_t p = a / GRAN; p <= (b + 3 * MiB - 1) / GRAN; p++) CHECK(fake_is_mapped(f, p * GRAN));
    CHECK(msh_pool_free(pool, a, 1) == 0);
    s = stats(pool);
    CHECK(s.touched_bytes == 2 * GRAN); /* page 1 is still shared with b */
    CHECK(s.mapped_bytes == 3 * GRAN);  /* page 0 stays cached */
    CHECK(s.free_bytes == 3 * MiB);     /* usable now without mapping: a's extent */
    CHECK(msh_pool_free(pool, b, 1) == 0);
    s = stats(pool);
    CHECK(s.touched_bytes == 0 && s.mapped_bytes == 3 * GRAN);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->live_resv == 0 && f->misuse == 0);
    free(f);
}

TEST(cached_pages_are_reused_without_map_ops)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a[6];
    for (int i = 0; i < 6; i++) REQUIRE(msh_pool_alloc(pool, (size_t)(i + 1) * 700 * 1024 + 3, 1, &a[i]) == 0);
    for (int i = 0; i < 6; i++) CHECK(msh_pool_free(pool, a[i], 1) == 0);
    long maps = f->calls[OP_MAP], creates = f->calls[OP_CREATE];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 6; i++) REQUIRE(msh_pool_alloc(pool, (size_t)(i + 1) * 700 * 1024 + 3, 1, &a[i]) == 0);
        for (int i = 5; i >= 0; i--) CHECK(msh_pool_free(pool, a[i], 1) == 0);
    }
    CHECK(f->calls[OP_MAP] == maps && f->calls[OP_CREATE] == creates);
    CHECK(f->calls[OP_UNMAP] == 0 && f->calls[OP_RELEASE] == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* ---- limits, reclaim and the rescue chain ----------------------------------------------------- */

/* Four 2 MiB blocks fill a 4-page limit; freeing the 1st and 3rd leaves two cached pages that no
 * 4 MiB request can use in place. */
static void fill_and_punch(struct msh_pool *pool, uint64_t blk[4])
{
    for (int i = 0; i < 4; i++)
        if (msh_pool_alloc(pool, 2 * MiB, 1, &blk[i])) blk[i] = 0;
    msh_pool_free(pool, blk[0], MSH_STREAM_COMPLETED);
    msh_pool_free(pool, blk[2], MSH_STREAM_COMPLETED);
}

static int gc_calls;
static struct msh_pool *gc_pool;
static uint64_t gc_victim;
static size_t gc_fn(void *arg)
{
    gc_calls++;
    CHECK(arg == &gc_calls);
    if (!gc_victim) return 0;
    /* Calls back into the pool: this deadlocks unless the pool released its lock. */
    size_t sz = msh_pool_block_size(gc_pool, gc_victim);
    CHECK(msh_pool_free(gc_pool, gc_victim, MSH_STREAM_COMPLETED) == 0);
    gc_victim = 0;
    return sz;
}

static void gc_arm(struct msh_pool *pool, uint64_t victim)
{
    gc_calls = 0;
    gc_pool = pool;
    gc_victim = victim;
    msh_pool_set_gc(pool, gc_fn, &gc_calls);
}

TEST(limit_with_defrag_reclaims_cached_pages)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0);
    REQUIRE(pool);
    uint64_t blk[4], e;
    fill_and_punch(pool, blk);
    REQUIRE(blk[0] && blk[1] && blk[2] && blk[3]);
    gc_arm(pool, 0);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 1, &e) == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.create_ops == 4);          /* the limit capped handles */
    CHECK(s.reclaimed_pages == 2);     /* both cached pages were unmapped and remapped */
    CHECK(s.unmap_ops == 2 && s.map_ops == 6);
    CHECK(s.rescue_reclaim == 1 && s.rescue_gc == 0 && s.rescue_empty_cache == 0);
    CHECK(s.oom_events == 0);
    CHECK(gc_calls == 0);              /* reclaim comes before the GC callback */
    CHECK(s.mapped_bytes == 8 * MiB && f->live_handles == 4);
    for (uint64_t p = e / GRAN; p <= (e + 4 * MiB - 1) / GRAN; p++) CHECK(fake_is_mapped(f, p * GRAN));
    CHECK(overlaps(pool, NULL) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(limit_without_defrag_releases_cached_pages_before_failing)
{
    /* defrag off: no reclaim. Under the limit the chain goes on to the GC callback and then must
     * give the cached pages back, which lets it create new ones where the request needs them
     * (issue 8: it used to fail while 4 MiB of cached pages sat unused). */
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, false, 0);
    REQUIRE(pool);
    uint64_t blk[4], e;
    fill_and_punch(pool, blk);
    gc_arm(pool, 0);
    int rc = msh_pool_alloc(pool, 4 * MiB, 1, &e);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.reclaimed_pages == 0 && s.rescue_reclaim == 0);
    CHECK(gc_calls == 1);
    CHECKF(rc == 0, "rc %d", rc);
    /* four one-page handles, two released, and under a limit one handle per page of the block */
    CHECK(s.rescue_empty_cache == 1 && s.released_pages == 2 && s.create_ops == 6);
    CHECK(s.oom_events == 0);
    if (rc == 0) CHECK(msh_pool_free(pool, e, 1) == 0);
    /* live 4 MiB of 8: a 6 MiB request cannot fit whatever the chain does */
    CHECK(msh_pool_alloc(pool, 6 * MiB, 1, &e) == ENOMEM);
    s = stats(pool);
    CHECK(s.oom_events >= 1 && s.alloc_fail >= 1);
    CHECK(s.mapped_bytes <= 8 * MiB);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* Issue 8's entry points (hooks/ call them), over this pool's handles: after each, every pool
 * invariant still holds. */
static long fk_events_on(struct fake *f, uint64_t stream)
{
    long n = 0;
    for (int i = 0; i < f->nlog; i++) n += f->log[i].op == 'E' && f->log[i].a == stream;
    return n;
}

TEST(forget_stream_block_containing_and_free_release)
{
    struct fake *f = fake_new(0, 0);
    /* at the limit: memory freed on another stream is reused after a synchronize, not replaced */
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0);
    REQUIRE(pool);
    uint64_t a, b, c, base = 0;
    size_t size = 0, rel = 0;
    /* a block freed on stream 7, which is then destroyed: reuse elsewhere synchronizes instead of
     * recording an event on the dead stream */
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 7, &a) == 0);
    CHECK(msh_pool_free(pool, a, 7) == 0);
    CHECK(msh_pool_forget_stream(pool, 7) == 0);
    pool_checked(pool, "msh_pool_forget_stream", __FILE__, __LINE__);
    long sync0 = f->calls[OP_SYNC];
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 8, &b) == 0);
    CHECK(b == a);
    CHECK(fk_events_on(f, 7) == 0 && f->calls[OP_SYNC] == sync0 + 1);
    /* a live block also used on stream 9, which goes away before the block is freed (the pool
     * has seen two streams by now: the free records an event on 8, none on 9) */
    CHECK(msh_pool_record_stream(pool, b, 9) == 0);
    CHECK(msh_pool_forget_stream(pool, 9) == 0);
    pool_checked(pool, "msh_pool_forget_stream", __FILE__, __LINE__);
    CHECK(msh_pool_free(pool, b, 8) == 0);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 10, &c) == 0);
    CHECK(fk_events_on(f, 9) == 0 && f->calls[OP_SYNC] == sync0 + 2);
    CHECK(msh_pool_free(pool, c, 10) == 0);
    /* interior addresses find their block; bytes past the request do not */
    REQUIRE(msh_pool_alloc(pool, 5 * MiB + 100, MSH_STREAM_COMPLETED, &c) == 0);
    CHECK(msh_pool_block_containing(pool, c + 4 * MiB, &base, &size) == 0 && base == c && size == 5 * MiB + 100);
    CHECK(msh_pool_block_containing(pool, c + 5 * MiB + 100, &base, &size) == EINVAL);
    CHECK(msh_pool_covers(pool, c + 5 * MiB + 100) && !msh_pool_covers(pool, 4096));
    /* freeing with release gives back the handles on its pages that nothing else touches */
    struct msh_pool_counters k0, k1;
    msh_pool_counters(pool, &k0);
    long unmaps0 = f->calls[OP_UNMAP];
    CHECK(msh_pool_free_release(pool, c, MSH_STREAM_COMPLETED, &rel) == 0);
    pool_checked(pool, "msh_pool_free_release", __FILE__, __LINE__);
    msh_pool_counters(pool, &k1);
    CHECK(rel == 3 * GRAN && f->calls[OP_UNMAP] - unmaps0 >= 1);
    CHECK(k1.handles == k0.handles - 3 && k1.touched_pages == 0 && k1.live_bytes == 0);
    CHECK(msh_pool_free_release(pool, c, MSH_STREAM_COMPLETED, &rel) == EINVAL);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(rescue_chain_order_reuse_map_reclaim_gc_empty_cache_fail)
{
    /* 1. reuse: no device call at all */
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0);
    REQUIRE(pool);
    gc_arm(pool, 0);
    uint64_t x, blk[4], e;
    REQUIRE(msh_pool_alloc(pool, MiB + 512, 1, &x) == 0);
    CHECK(msh_pool_free(pool, x, 1) == 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, MiB + 512, 1, &x) == 0);
    CHECK(f->nlog == 0);
    CHECK(msh_pool_free(pool, x, 1) == 0);
    msh_pool_empty_cache(pool);
    /* 2. map new: create + map, nothing else */
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &x) == 0);
    CHECK(fake_log_count(f, 'C') == 1 && fake_log_count(f, 'M') == 1 && fake_log_count(f, 'U') == 0);
    CHECK(msh_pool_free(pool, x, MSH_STREAM_COMPLETED) == 0);
    msh_pool_empty_cache(pool);
    /* 3. reclaim before GC */
    fill_and_punch(pool, blk);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 1, &e) == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.rescue_reclaim == 1 && gc_calls == 0 && s.rescue_gc == 0);
    CHECK(fake_log_count(f, 'U') == 2 && fake_log_count(f, 'M') == 2 && fake_log_count(f, 'R') == 0);
    /* 4. GC: every page live, nothing cached; the callback frees blk[1] (from inside) */
    REQUIRE(overlaps(pool, NULL) == 0);
    gc_arm(pool, blk[1]);
    uint64_t g;
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &g) == 0);
    s = stats(pool);
    /* the freed page becomes cached and is remapped into the best-fit hole (a reclaim inside
     * the GC retry), or reused in place */
    CHECK(gc_calls == 1 && s.rescue_gc == 1 && s.rescue_empty_cache == 0);
    CHECK(!msh_pool_owns(pool, blk[1]) || g == blk[1]);
    CHECK(fake_is_mapped(f, g));
    CHECK(s.mapped_bytes == 8 * MiB && s.live_blocks == 3);
    /* 5. fail: GC has nothing left, nothing cached */
    gc_arm(pool, 0);
    int rc = msh_pool_alloc(pool, 2 * MiB, 1, &x);
    s = stats(pool);
    CHECK(rc == ENOMEM);
    CHECK(gc_calls == 1 && s.oom_events == 1 && s.alloc_fail == 1);
    CHECK(s.rescue_gc == 1 && s.rescue_empty_cache == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);

    /* 6. empty cache: the DRIVER is out of memory (capacity 8 MiB, no pool limit), defrag off:
     * the device, asked before the first create (issue 25), has no room, so nothing is created;
     * the GC callback comes first (frees nothing), then empty-cache gives the cached pages back
     * to the driver and the retry creates new ones. */
    f = fake_new(8 * MiB, 0);
    pool = mk_pool(&f->dev, 0, false, 0);
    REQUIRE(pool);
    fill_and_punch(pool, blk);
    gc_arm(pool, 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 1, &e) == 0);
    s = stats(pool);
    CHECK(gc_calls == 1 && s.rescue_empty_cache == 1 && s.rescue_gc == 0 && s.rescue_reclaim == 0);
    CHECK(s.released_pages == 2 && s.oom_events == 0);
    /* order in the device log: (GC), unmap+release of cached pages, create+map; no create the
     * driver refused (before issue 25 the first try created until it did) */
    int c0 = fake_log_find(f, 'C', 0), u0 = fake_log_find(f, 'U', 0), r0 = fake_log_find(f, 'R', 0);
    int m0 = fake_log_find(f, 'M', 0);
    CHECK(u0 >= 0 && r0 > u0 && c0 > r0 && m0 > c0);
    CHECK(fake_log_count(f, 'C') == 2);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* Issue 30: while one stream alone uses the pool its frees leave no stream tag (streams.c
 * solo_end). A destroyed stream's handle value may come back for a new stream: the pool must not
 * take the newcomer for the one stream it knew, whose queued work may still touch the memory it
 * freed (at the limit: the same memory, after a synchronize). */
TEST(one_stream_regime_a_handle_reused_after_its_stream_was_destroyed_still_waits)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0);
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 7, &a) == 0);
    CHECK(msh_pool_free(pool, a, 7) == 0);
    CHECK(stats(pool).solo_ends == 0); /* one stream so far: no tag was left */
    CHECK(msh_pool_forget_stream(pool, 7) == 0);
    pool_checked(pool, "msh_pool_forget_stream", __FILE__, __LINE__);
    CHECK(stats(pool).solo_ends == 1);
    long sync0 = f->calls[OP_SYNC];
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 7, &b) == 0); /* a new stream with the old handle value */
    CHECK(b == a && f->calls[OP_SYNC] == sync0 + 1);
    CHECK(msh_pool_free(pool, b, 7) == 0);
    pool_checked(pool, "the free on the new stream", __FILE__, __LINE__);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* The regime in numbers: pairs on one stream leave no tag and end nothing; a second stream ends it
 * once, and memory the first one freed is then reused elsewhere only after a synchronize (no event
 * was recorded for it), while memory freed as complete (MSH_STREAM_COMPLETED) before the second
 * stream came is reused at once: the spans the regime keeps are the bytes of its untagged frees,
 * not the whole line. */
TEST(one_stream_regime_ends_once_and_tags_only_what_its_stream_freed)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, c, x, b;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    REQUIRE(msh_pool_alloc(pool, 5 * MiB, 11, &c) == 0); /* a live block between */
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &x) == 0);
    for (int i = 0; i < 50; i++) {
        uint64_t t;
        REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &t) == 0);
        CHECK(msh_pool_free(pool, t, 11) == 0);
    }
    CHECK(msh_pool_free(pool, a, 11) == 0);
    CHECK(msh_pool_free(pool, x, MSH_STREAM_COMPLETED) == 0); /* known complete: no queued work */
    pool_checked(pool, "one stream", __FILE__, __LINE__);
    CHECK(stats(pool).solo_ends == 0 && f->calls[OP_SYNC] == 0 && f->calls[OP_EVREC] == 0);
    long sync0 = f->calls[OP_SYNC];
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 22, &b) == 0);
    pool_checked(pool, "the second stream", __FILE__, __LINE__);
    CHECK(stats(pool).solo_ends == 1);
    CHECK(b != a); /* a's bytes wait for stream 11 */
    CHECK(b == x && f->calls[OP_SYNC] == sync0 && f->nlog == 0); /* x's bytes are clean: at once */
    CHECK(msh_pool_free(pool, b, 22) == 0);
    /* another new stream ends nothing more */
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 33, &b) == 0);
    CHECK(msh_pool_free(pool, b, 33) == 0);
    CHECK(stats(pool).solo_ends == 1);
    CHECK(msh_pool_free(pool, c, 11) == 0);
    pool_checked(pool, "the end", __FILE__, __LINE__);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* The span of the one stream's untagged frees stays with its bytes when a request carves them and
 * then fails: the block goes back with the span, so the stream that comes next still waits for
 * the first one's work there (at the limit: the same memory, after a synchronize). */
TEST(one_stream_regime_a_failed_request_gives_its_extent_back_with_the_span)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0); /* 4 pages */
    REQUIRE(pool);
    uint64_t x, a, b, c;
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 11, &x) == 0);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 11, &a) == 0);
    CHECK(msh_pool_free(pool, a, 11) == 0); /* a's 2 pages cached, untagged, its span kept */
    /* 6 MiB from a's bytes on: a third page over the limit, and nothing to reclaim but a's own */
    CHECK(msh_pool_alloc(pool, 6 * MiB, 11, &c) == ENOMEM);
    pool_checked(pool, "the failed request", __FILE__, __LINE__);
    CHECK(stats(pool).solo_ends == 0);
    long sync0 = f->calls[OP_SYNC];
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 22, &b) == 0);
    CHECK(stats(pool).solo_ends == 1);
    CHECK(b == a && f->calls[OP_SYNC] == sync0 + 1);
    CHECK(msh_pool_free(pool, b, 22) == 0);
    CHECK(msh_pool_free(pool, x, 11) == 0);
    pool_checked(pool, "the end", __FILE__, __LINE__);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* A synchronize covers the one stream's untagged frees as it covered their tags: when a second
 * stream comes after one, that memory is clean, and it is reused at once (no second synchronize,
 * no fresh memory instead). The tags the end of the regime makes keep each free's number and
 * generation, as the frees would have left them. */
TEST(one_stream_regime_a_synchronize_before_the_second_stream_covers_its_frees)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0);
    REQUIRE(pool);
    uint64_t x, a, b;
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 11, &x) == 0);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 11, &a) == 0);
    CHECK(msh_pool_free(pool, a, 11) == 0);
    long sync0 = f->calls[OP_SYNC];
    CHECK(msh_pool_empty_cache(pool) == 2 * GRAN); /* a's pages: unmapped after one synchronize */
    CHECK(f->calls[OP_SYNC] == sync0 + 1);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 22, &b) == 0);
    pool_checked(pool, "the second stream", __FILE__, __LINE__);
    CHECK(stats(pool).solo_ends == 1);
    CHECK(b == a && f->calls[OP_SYNC] == sync0 + 1 && stats(pool).cross_stream_waits == 0);
    CHECK(msh_pool_free(pool, b, 22) == 0);
    CHECK(msh_pool_free(pool, x, 11) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

TEST(oom_diagnosis_capacity_and_fragmentation)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 16 * MiB, true, MiB);
    REQUIRE(pool);
    /* capacity: live blocks fill the limit */
    static const size_t sz[] = {3 * MiB, 1 * MiB + 4096, 5 * MiB, 1536 * 1024, 2 * MiB + 512, 2 * MiB};
    uint64_t a[6];
    size_t live = 0;
    for (int i = 0; i < 6; i++) {
        REQUIRE(msh_pool_alloc(pool, sz[i], 1, &a[i]) == 0);
        live += sz[i];
    }
    uint64_t x;
    CHECK(msh_pool_alloc(pool, 8 * MiB, 1, &x) == ENOMEM);
    struct msh_pool_oom o;
    msh_pool_last_oom(pool, &o);
    CHECK(o.requested == 8 * MiB);
    CHECK(o.live_bytes == live);
    CHECK(o.limit_bytes == 16 * MiB);
    CHECK(o.mapped_bytes <= 16 * MiB);
    CHECK(!o.fragmentation); /* live + requested > limit */
    CHECK(o.ntop == 5);
    CHECK(o.top[0].size == 5 * MiB && o.top[0].addr == a[2]);
    CHECK(o.top[1].size == 3 * MiB && o.top[1].addr == a[0]);
    CHECK(o.top[2].size == 2 * MiB + 512);
    CHECK(o.top[3].size == 2 * MiB);
    CHECK(o.top[4].size == 1536 * 1024);
    for (int i = 1; i < o.ntop; i++) CHECK(o.top[i - 1].size >= o.top[i].size);
    for (int i = 0; i < 6; i++) CHECK(msh_pool_free(pool, a[i], 1) == 0);
    msh_pool_destroy(pool);
    free(f);

    /* fragmentation: small 1 MiB blocks fill every page of an 8 MiB limit; every other one is
     * freed: 4 MiB free, but each page is pinned by a live neighbour, so 2 MiB do not fit */
    f = fake_new(0, 0);
    pool = mk_pool(&f->dev, 8 * MiB, true, MiB);
    REQUIRE(pool);
    uint64_t s[8];
    for (int i = 0; i < 8; i++) REQUIRE(msh_pool_alloc(pool, MiB, 1, &s[i]) == 0);
    for (int i = 0; i < 8; i += 2) CHECK(msh_pool_free(pool, s[i], 1) == 0);
    struct msh_pool_stats st = stats(pool);
    CHECK(st.free_bytes == 4 * MiB && st.largest_free == MiB);
    CHECK(msh_pool_alloc(pool, 2 * MiB, 1, &x) == ENOMEM);
    msh_pool_last_oom(pool, &o);
    CHECK(o.requested == 2 * MiB && o.live_bytes == 4 * MiB && o.fragmentation);
    CHECK(o.largest_free == MiB);
    CHECK(o.ntop == 4);
    for (int i = 0; i < o.ntop; i++) CHECK(o.top[i].size == MiB);
    for (int i = 1; i < 8; i += 2) CHECK(msh_pool_free(pool, s[i], 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(empty_cache_releases_exactly_the_cached_pages)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a[20];
    uint32_t r = 7;
    for (int i = 0; i < 20; i++) REQUIRE(msh_pool_alloc(pool, 1 + rng_next(&r) % (6 * MiB), 1, &a[i]) == 0);
    for (int i = 0; i < 20; i += 3) CHECK(msh_pool_free(pool, a[i], MSH_STREAM_COMPLETED) == 0);
    struct msh_pool_stats s0 = stats(pool);
    size_t cached = s0.mapped_bytes - s0.touched_bytes;
    CHECK(cached > 0);
    size_t rel = msh_pool_empty_cache(pool);
    struct msh_pool_stats s1 = stats(pool);
    CHECK(rel == cached);
    CHECK(s1.released_pages - s0.released_pages == cached / GRAN);
    CHECK(s1.mapped_bytes == s0.touched_bytes && s1.touched_bytes == s0.touched_bytes);
    CHECK(f->live_bytes == s1.mapped_bytes && fake_mapped_bytes(f) == s1.mapped_bytes);
    CHECK(msh_pool_empty_cache(pool) == 0);
    /* every live block is still fully mapped */
    for (int i = 0; i < 20; i++) {
        if (i % 3 == 0) continue;
        size_t sz = msh_pool_block_size(pool, a[i]);
        for (uint64_t p = a[i] / GRAN; p <= (a[i] + (sz ? sz : 1) - 1) / GRAN; p++)
            CHECK(fake_is_mapped(f, p * GRAN));
    }
    for (int i = 0; i < 20; i++)
        if (i % 3) CHECK(msh_pool_free(pool, a[i], 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(release_threshold_gives_back_cached_bytes_once_they_stay_unused)
{
    /* MEMSHIM_EMPTY_CACHE=threshold: cached bytes above the threshold go back to the driver once
     * they have not been reused for the quiet period (here 100 ms), not at once. */
    struct fake *f = fake_new(0, 0);
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.va_bytes = 8 * GiB;
    p.ahead_bytes = GRAN;
    p.release_threshold = 4 * MiB;
    p.release_quiet_ms = 100;
    struct msh_pool *pool = NULL;
    REQUIRE(msh_pool_create(&f->dev, &p, &pool) == 0);
    uint64_t a[10];
    for (int i = 0; i < 10; i++) REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &a[i]) == 0);
    for (int i = 0; i < 10; i++) CHECK(msh_pool_free(pool, a[i], 1) == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.mapped_bytes == 20 * MiB && s.released_pages == 0); /* just freed: kept for now */
    usleep(150 * 1000);
    fake_log_clear(f);
    CHECK(msh_pool_trim(pool) == 16 * MiB); /* the background trim (core.c's watcher) */
    s = stats(pool);
    CHECK(s.mapped_bytes == 4 * MiB && s.released_pages == 8);
    /* the release unmapped pages freed on a stream: a synchronize came first */
    int u = fake_log_find(f, 'U', 0), sy = fake_log_find(f, 'S', 0);
    CHECK(u >= 0 && sy >= 0 && sy < u);
    CHECK(msh_pool_trim(pool) == 0);
    /* a free past the quiet period trims too */
    for (int i = 0; i < 4; i++) REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &a[i]) == 0);
    for (int i = 0; i < 4; i++) CHECK(msh_pool_free(pool, a[i], 1) == 0);
    CHECK(stats(pool).mapped_bytes == 8 * MiB);
    usleep(150 * 1000);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &a[0]) == 0);
    CHECK(msh_pool_free(pool, a[0], 1) == 0);
    CHECK(stats(pool).mapped_bytes - stats(pool).touched_bytes <= 4 * MiB);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(release_threshold_steady_loop_around_it_maps_nothing)
{
    /* issue 10: a loop whose cached bytes hover around the threshold used to synchronize, unmap
     * and map on every iteration. Now: after the first iteration, nothing at all. */
    struct fake *f = fake_new(0, 0);
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.va_bytes = 8 * GiB;
    p.ahead_bytes = GRAN;
    p.release_threshold = 6 * MiB;
    struct msh_pool *pool = NULL;
    REQUIRE(msh_pool_create(&f->dev, &p, &pool) == 0);
    uint64_t keep, a[5];
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 1, &keep) == 0);
    long maps[20], unmaps[20], syncs[20];
    for (int it = 0; it < 20; it++) {
        long m0 = f->calls[OP_MAP], u0 = f->calls[OP_UNMAP], s0 = f->calls[OP_SYNC];
        /* 10 MiB of activations, freed: the cache goes up to 10 MiB, above the 6 MiB threshold */
        for (int i = 0; i < 5; i++) REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &a[i]) == 0);
        for (int i = 0; i < 5; i++) CHECK(msh_pool_free(pool, a[i], 1) == 0);
        maps[it] = f->calls[OP_MAP] - m0;
        unmaps[it] = f->calls[OP_UNMAP] - u0;
        syncs[it] = f->calls[OP_SYNC] - s0;
    }
    CHECK(maps[0] == 5);
    for (int it = 1; it < 20; it++)
        CHECKF(maps[it] == 0 && unmaps[it] == 0 && syncs[it] == 0, "iteration %d: %ld maps, %ld unmaps, %ld synchronizes",
               it, maps[it], unmaps[it], syncs[it]);
    CHECK(msh_pool_free(pool, keep, 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* ---- streams ---------------------------------------------------------------------------------------- */

TEST(stream_same_stream_reuse_needs_no_event)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    CHECK(msh_pool_free(pool, a, 11) == 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &b) == 0);
    CHECK(b == a);
    CHECK(f->nlog == 0);
    CHECK(stats(pool).cross_stream_waits == 0);
    CHECK(msh_pool_free(pool, b, 11) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* Issue 15 item 3: once one block had been used on a side stream, every later alloc/free pair on
 * either stream recorded an event and made a cross-stream wait (1000 pairs: 1000 of each). As in
 * PyTorch's allocator, a block used on its own stream only needs no event, whatever else the pool
 * has seen. */
TEST(stream_pairs_after_a_side_stream_make_no_driver_call)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t side, x, y;
    REQUIRE(msh_pool_alloc(pool, 64 * 1024, 22, &side) == 0); /* an NCCL-like stream */
    CHECK(msh_pool_record_stream(pool, side, 11) == 0);
    CHECK(msh_pool_free(pool, side, 22) == 0); /* a hand-off: one event, on 11 */
    /* settling in: the hand-off's bytes may make 22 want 11's memory once, and then 11's next
     * frees record events for a while (a window of 256 frees) */
    for (int i = 0; i < 300; i++) {
        REQUIRE(msh_pool_alloc(pool, 64 * 1024, 11, &x) == 0);
        REQUIRE(msh_pool_alloc(pool, 64 * 1024, 22, &y) == 0);
        CHECK(msh_pool_free(pool, x, 11) == 0);
        CHECK(msh_pool_free(pool, y, 22) == 0);
    }
    long rec0 = f->calls[OP_EVREC], wait0 = f->calls[OP_WAIT], sync0 = f->calls[OP_SYNC];
    for (int i = 0; i < 1000; i++) {
        REQUIRE(msh_pool_alloc(pool, 64 * 1024, 11, &x) == 0);
        REQUIRE(msh_pool_alloc(pool, 64 * 1024, 22, &y) == 0);
        CHECK(msh_pool_free(pool, x, 11) == 0);
        CHECK(msh_pool_free(pool, y, 22) == 0);
    }
    long rec = f->calls[OP_EVREC] - rec0, wait = f->calls[OP_WAIT] - wait0, sync = f->calls[OP_SYNC] - sync0;
    CHECKF(rec == 0 && wait == 0 && sync == 0, "1000 pairs on each stream: %ld event records, %ld waits, %ld syncs",
           rec, wait, sync);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* Memory freed on 11 without an event, wanted by 22: nothing is ever recorded on 11 at reuse time
 * (that would make 22 wait for all of 11's later work). With room to spare, 22 gets other memory
 * and 11 is asked for a marker: its next free records one event, and once that is seen complete
 * every earlier free of 11 serves 22 at once. */
TEST(stream_reuse_elsewhere_never_records_at_reuse_time)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, b, guard, m, c;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, MSH_STREAM_COMPLETED, &guard) == 0); /* bounds the hole */
    CHECK(msh_pool_free(pool, a, 11) == 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 22, &b) == 0);
    CHECK(b != a);                                   /* fresh memory, not a's */
    CHECK(fake_log_count(f, 'E') == 0 && fake_log_count(f, 'W') == 0 && fake_log_count(f, 'S') == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.reuse_event_records == 0 && s.free_event_records == 0);
    /* 11's next free records the marker, the next allocation queries it (the fake: complete) */
    REQUIRE(msh_pool_alloc(pool, 64 * 1024, 11, &m) == 0);
    fake_log_clear(f);
    CHECK(msh_pool_free(pool, m, 11) == 0);
    CHECK(fk_events_on(f, 11) == 1 && stats(pool).demand_records == 1);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 22, &c) == 0);
    CHECK(c == a);                                   /* a's memory serves 22 now */
    CHECK(fake_log_count(f, 'q') >= 1 && fake_log_count(f, 'E') == 0 && fake_log_count(f, 'W') == 0);
    CHECK(msh_pool_free(pool, c, 22) == 0);
    CHECK(msh_pool_free(pool, b, 22) == 0);
    CHECK(msh_pool_free(pool, guard, 22) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* Under a limit there is no room for fresh memory: the extent is reused after a synchronize (as
 * PyTorch's allocator frees its cache under pressure), still without an event on the old stream. */
TEST(stream_reuse_elsewhere_at_the_limit_synchronizes)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0);
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 6 * MiB, 11, &a) == 0);
    CHECK(msh_pool_free(pool, a, 11) == 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 6 * MiB, 22, &b) == 0);
    CHECK(b == a);
    CHECK(fake_log_count(f, 'S') == 1 && fake_log_count(f, 'E') == 0 && fake_log_count(f, 'W') == 0);
    CHECK(msh_pool_free(pool, b, 22) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* record_stream: as PyTorch, one event per other stream that used the block, recorded at the
 * free, and none on the free's own stream. A reuse queries it first: complete, no wait at all;
 * still pending, one wait on it (never a synchronize, never an event recorded then). */
TEST(stream_record_stream_records_at_the_free_and_waits_only_if_pending)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0); /* at the limit: a's memory is wanted */
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 6 * MiB, 11, &a) == 0);
    CHECK(msh_pool_record_stream(pool, a, 33) == 0);
    CHECK(msh_pool_record_stream(pool, a, 33) == 0); /* twice: one stream */
    fake_log_clear(f);
    CHECK(msh_pool_free(pool, a, 11) == 0);
    CHECK(fake_log_count(f, 'E') == 1 && fk_events_on(f, 33) == 1);
    uint64_t ev = f->log[fake_log_find(f, 'E', 0)].b;
    f->ev_busy = true; /* the GPU is behind: the event is not complete yet */
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 6 * MiB, 11, &b) == 0);
    CHECK(b == a);
    int w = fake_log_find(f, 'W', 0);
    CHECK(w >= 0 && f->log[w].a == 11 && f->log[w].b == ev);
    CHECK(fake_log_count(f, 'W') == 1 && fake_log_count(f, 'E') == 0 && fake_log_count(f, 'S') == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.cross_stream_waits == 1 && s.cross_stream_reuses == 1 && s.free_event_records == 1);
    CHECK(msh_pool_record_stream(pool, b, 33) == 0);
    CHECK(msh_pool_free(pool, b, 11) == 0);
    f->ev_busy = false; /* done by now */
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 6 * MiB, 11, &b) == 0);
    CHECK(b == a && fake_log_count(f, 'W') == 0 && fake_log_count(f, 'S') == 0); /* queried complete */
    CHECK(msh_pool_free(pool, b, 11) == 0);
    /* 44: 11's own part has no event, and there is no room elsewhere: a synchronize, no record */
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 6 * MiB, 44, &b) == 0);
    CHECK(b == a && fake_log_count(f, 'S') == 1 && fake_log_count(f, 'E') == 0 && fake_log_count(f, 'W') == 0);
    CHECK(msh_pool_free(pool, b, 44) == 0);
    CHECK(f->calls[OP_EVCREATE] <= 2); /* pooled: recorded again, not created per free */
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

TEST(stream_completed_free_needs_no_wait)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    CHECK(msh_pool_free(pool, a, MSH_STREAM_COMPLETED) == 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 22, &b) == 0);
    CHECK(b == a && f->nlog == 0);
    CHECK(msh_pool_free(pool, b, MSH_STREAM_COMPLETED) == 0);
    /* ... and nothing to synchronize before unmapping */
    fake_log_clear(f);
    CHECK(msh_pool_empty_cache(pool) == 2 * GRAN);
    CHECK(fake_log_count(f, 'S') == 0 && fake_log_count(f, 'U') == 2);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

TEST(stream_host_alloc_of_stream_freed_block_synchronizes)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0); /* at the limit: a's memory or none */
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    CHECK(msh_pool_free(pool, a, 11) == 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, MSH_STREAM_COMPLETED, &b) == 0);
    CHECK(b == a);
    CHECK(fake_log_count(f, 'S') == 1 && fake_log_count(f, 'E') == 0);
    CHECK(msh_pool_free(pool, b, MSH_STREAM_COMPLETED) == 0);
    /* the synchronize covered everything: no second one for the unmaps */
    fake_log_clear(f);
    msh_pool_empty_cache(pool);
    CHECK(fake_log_count(f, 'S') == 0 && fake_log_count(f, 'U') > 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* With room to grow, a host-synchronous user (cudaMalloc) of memory last used on a stream still
 * reuses it after a synchronize rather than mapping new pages: it costs one wait, where growing
 * instead raised a soak over the real traces from 967 handles to 24,898 (60 GiB, the pool's room,
 * for a 7 GiB live set). Streams keep mapping fresh memory instead of waiting (fresh placements). */
TEST(stream_host_alloc_with_room_reuses_after_synchronize)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    CHECK(msh_pool_free(pool, a, 11) == 0);
    fake_log_clear(f);
    long maps = f->calls[OP_MAP];
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, MSH_STREAM_COMPLETED, &b) == 0);
    CHECKF(b == a && f->calls[OP_MAP] == maps, "host alloc at %#llx (freed block at %#llx), %ld new maps",
           (unsigned long long)b, (unsigned long long)a, f->calls[OP_MAP] - maps);
    CHECK(fake_log_count(f, 'S') == 1 && fake_log_count(f, 'E') == 0);
    CHECK(stats(pool).fresh_placements == 0);
    CHECK(msh_pool_free(pool, b, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* The context of a stream is asked for (stream_home) with the pool's lock dropped, during a free
 * that records an event for another stream: the block being freed was out of the live hash but
 * still said live, so a check (or a lookup) on another thread found a live block that is not
 * live (seen by ThreadSanitizer's stress run: "live block ... is not in the hash"). */
TEST(stream_free_is_consistent_while_a_stream_context_is_asked_for)
{
    struct fake *f = fake_new(0, 0);
    fake_ops_home = fake_ops;
    fake_ops_home.stream_home = fk_stream_home;
    f->dev.ops = &fake_ops_home;
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    CHECK(msh_pool_record_stream(pool, a, 12) == 0);
    f->probe = pool;
    CHECK(msh_pool_free(pool, a, 11) == 0);
    f->probe = NULL;
    CHECKF(f->probe_bad == 0, "checked with the lock dropped: %s", f->probe_why);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* A stream of another context (stream_home answers its context): the event a free records for it
 * is made in that context (event_create_on), since the driver refuses an event of one context on
 * a stream of another. Streams of the device's own context (home 0) get a plain event. */
static uint64_t home_calls, home_last;
static int fk_stream_home_other(struct msh_device *d __attribute__((unused)), uint64_t stream, uint64_t *home)
{
    *home = stream == 12 ? 0xC0 : 0;
    return 0;
}
static int fk_event_create_on(struct msh_device *d, uint64_t home, uint64_t *ev)
{
    home_calls++;
    home_last = home;
    return fk_event_create(d, ev);
}

TEST(an_event_for_a_stream_of_another_context_is_made_in_that_context)
{
    struct fake *f = fake_new(0, 0);
    static struct msh_device_ops ops;
    ops = fake_ops;
    ops.stream_home = fk_stream_home_other;
    ops.event_create_on = fk_event_create_on;
    f->dev.ops = &ops;
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    home_calls = home_last = 0;
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    CHECK(msh_pool_record_stream(pool, a, 12) == 0); /* stream 12: context 0xC0 */
    CHECK(msh_pool_free(pool, a, 11) == 0);
    CHECKF(home_calls == 1 && home_last == 0xC0, "event_create_on called %llu times, last home %#llx",
           (unsigned long long)home_calls, (unsigned long long)home_last);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 13, &b) == 0);
    CHECK(msh_pool_record_stream(pool, b, 14) == 0); /* stream 14: the device's own context */
    CHECK(msh_pool_free(pool, b, 13) == 0);
    CHECK(home_calls == 1);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

TEST(stream_record_stream_on_host_allocated_block_is_kept)
{
    /* A block allocated for host-synchronous use (MSH_STREAM_COMPLETED), then used on stream 33
     * (record_stream) and freed on stream 11: a reuse on stream 44 must wait for 11 AND 33. At
     * the limit (no fresh memory) it is reused after a synchronize; 33 got its event at the free. */
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0);
    REQUIRE(pool);
    uint64_t a, b;
    REQUIRE(msh_pool_alloc(pool, 6 * MiB, MSH_STREAM_COMPLETED, &a) == 0);
    CHECK(msh_pool_record_stream(pool, a, 33) == 0);
    fake_log_clear(f);
    CHECK(msh_pool_free(pool, a, 11) == 0);
    CHECK(fk_events_on(f, 33) == 1 && fk_events_on(f, 11) == 0);
    REQUIRE(msh_pool_alloc(pool, 6 * MiB, 44, &b) == 0);
    CHECK(b == a);
    CHECKF(fake_log_count(f, 'S') == 1, "stream 11's work is not waited for (syncs: %d)", fake_log_count(f, 'S'));
    CHECK(msh_pool_free(pool, b, 44) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

TEST(stream_unmap_is_preceded_by_synchronize)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 8 * MiB, true, 0);
    REQUIRE(pool);
    uint64_t blk[4], e;
    /* reclaim path: the punched blocks were freed on a stream */
    for (int i = 0; i < 4; i++) REQUIRE(msh_pool_alloc(pool, 2 * MiB, 5, &blk[i]) == 0);
    CHECK(msh_pool_free(pool, blk[0], 5) == 0);
    CHECK(msh_pool_free(pool, blk[2], 5) == 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 6, &e) == 0);
    int s0 = fake_log_find(f, 'S', 0), u0 = fake_log_find(f, 'U', 0);
    CHECK(u0 >= 0 && s0 >= 0 && s0 < u0);
    CHECK(fake_log_count(f, 'S') == 1); /* one synchronize covers both unmaps */
    CHECK(stats(pool).reclaimed_pages == 2);
    /* empty-cache path: freed on a stream since the last synchronize -> synchronize first */
    CHECK(msh_pool_free(pool, blk[1], 5) == 0);
    fake_log_clear(f);
    CHECK(msh_pool_empty_cache(pool) == GRAN);
    s0 = fake_log_find(f, 'S', 0);
    u0 = fake_log_find(f, 'U', 0);
    CHECK(u0 >= 0 && s0 >= 0 && s0 < u0);
    /* nothing freed on a stream since: no synchronize */
    CHECK(msh_pool_free(pool, blk[3], MSH_STREAM_COMPLETED) == 0);
    fake_log_clear(f);
    CHECK(msh_pool_empty_cache(pool) == GRAN);
    CHECK(fake_log_count(f, 'S') == 0 && fake_log_count(f, 'U') == 1);
    /* after a synchronize, a block freed before it is clean: reuse elsewhere needs no event */
    CHECK(msh_pool_free(pool, e, 6) == 0);
    fake_log_clear(f);
    msh_pool_empty_cache(pool); /* synchronizes (e was freed on 6) and unmaps */
    CHECK(fake_log_count(f, 'S') == 1);
    /* two neighbours freed on two streams stay apart (their tags differ): a host-synchronous
     * request takes clean memory beside them, with no synchronize */
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 5, &blk[0]) == 0);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 7, &blk[1]) == 0);
    CHECK(msh_pool_free(pool, blk[0], 5) == 0);
    CHECK(msh_pool_free(pool, blk[1], 7) == 0);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, MSH_STREAM_COMPLETED, &e) == 0);
    CHECK(e != blk[0] && e != blk[1] && fake_log_count(f, 'S') == 0);
    CHECK(msh_pool_free(pool, e, 9) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* Issue 15 item 3, "merging keeps tags exact": a block freed on 11 merges with the clean open
 * tail of the VA line, but its tags stay on its own bytes. Blocks carved from the tail for 22
 * wait for nothing (the old pool spread 11's tag over the whole merged extent: 8 waits). */
TEST(stream_tags_stay_on_their_bytes_through_coalescing)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, b[8];
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 11, &a) == 0);
    CHECK(msh_pool_free(pool, a, 11) == 0);
    fake_log_clear(f);
    for (int i = 0; i < 8; i++) REQUIRE(msh_pool_alloc(pool, 3 * MiB, 22, &b[i]) == 0);
    struct msh_pool_stats s = stats(pool);
    CHECKF(s.cross_stream_waits == 0 && fake_log_count(f, 'W') == 0 && fake_log_count(f, 'E') == 0 &&
               fake_log_count(f, 'S') == 0,
           "8 blocks carved on 22 beside bytes 11 used: %llu waits, %d records, %d syncs",
           (unsigned long long)s.cross_stream_waits, fake_log_count(f, 'E'), fake_log_count(f, 'S'));
    for (int i = 0; i < 8; i++) CHECK(b[i] != a);
    for (int i = 0; i < 8; i++) CHECK(msh_pool_free(pool, b[i], 22) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* 32 small allocation/free pairs on stream 11: the pool polls its outstanding events on the way
 * (every 16 allocations), as PyTorch's process_events does. */
static void poll_events(struct msh_pool *pool)
{
    uint64_t sm;
    for (int i = 0; i < 32; i++) {
        REQUIRE(msh_pool_alloc(pool, 64 * 1024, 11, &sm) == 0);
        CHECK(msh_pool_free(pool, sm, 11) == 0);
    }
}

/* One free extent, two tags: on q's bytes an event that completed after the extents merged, on
 * p's bytes a free with no event (it would need a synchronize). A request that fits beside p's tag
 * is served there at once, over the completed tag: only p's tag is in the way, so neither a wait
 * nor a synchronize (the generated mutant policy/pool/streams.c#001e06ed counted the completed tag
 * in the way too, and synchronized). */
TEST(stream_request_beside_a_pending_tag_is_served_over_a_completed_one)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 10 * MiB, true, 0); /* 4 large pages + 1 small: no fresh memory */
    REQUIRE(pool);
    uint64_t p, q, g, r;
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 22, &p) == 0);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 11, &q) == 0);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, MSH_STREAM_COMPLETED, &g) == 0); /* bounds the extent */
    REQUIRE(q == p + 2 * MiB && g == q + 4 * MiB);
    f->ev_busy = true; /* the GPU is behind */
    CHECK(msh_pool_record_stream(pool, q, 33) == 0);
    CHECK(msh_pool_free(pool, q, 11) == 0); /* an event on 33, pending */
    CHECK(msh_pool_free(pool, p, 22) == 0); /* p and q one extent; 22's tag on p's bytes has no event */
    f->ev_busy = false;                     /* 33's work is done */
    poll_events(pool); /* 33's event is seen complete */
    struct msh_pool_stats s0 = stats(pool);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 11, &r) == 0);
    struct msh_pool_stats s1 = stats(pool);
    CHECKF(r == q, "served at +%lld MiB of the extent, not at q's bytes beside p's", (long long)(r - p) / (long long)MiB);
    CHECKF(fake_log_count(f, 'W') == 0 && fake_log_count(f, 'S') == 0 && s1.cross_stream_waits == s0.cross_stream_waits,
           "%d waits, %d synchronizes", fake_log_count(f, 'W'), fake_log_count(f, 'S'));
    CHECK(msh_pool_free(pool, r, 11) == 0);
    CHECK(msh_pool_free(pool, g, 11) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* An event covers only the work queued on its stream before it was recorded. The record is made
 * with the pool's lock dropped; a free on the event's stream made meanwhile (another thread) may
 * have queued its work after the record, so the event's completion says nothing of it: the event
 * is numbered before the record. Numbered after it (the hand mutant pool-event-seq-after-record),
 * y, freed on 33 during the record, counted as complete once the event was, and stream 22 reused
 * it with neither a wait nor a synchronize while 33 might still use it. */
TEST(stream_a_free_made_while_an_event_is_recorded_is_not_covered_by_it)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t x, g1, y, g2, r;
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 11, &x) == 0);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, MSH_STREAM_COMPLETED, &g1) == 0);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 33, &y) == 0);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, MSH_STREAM_COMPLETED, &g2) == 0);
    CHECK(msh_pool_record_stream(pool, x, 33) == 0);
    f->rec_free_pool = pool; /* x's free records an event on 33; y is freed on 33 meanwhile */
    f->rec_free_addr = y;
    f->rec_free_stream = 33;
    CHECK(msh_pool_free(pool, x, 11) == 0);
    CHECK(f->rec_free_pool == NULL && fk_events_on(f, 33) == 1);
    poll_events(pool); /* the event is seen complete */
    CHECK(fake_log_count(f, 'q') >= 1);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 22, &r) == 0);
    CHECKF(r != y || fake_log_count(f, 'W') + fake_log_count(f, 'S') > 0,
           "y's extent served stream 22 with no wait and no synchronize: its work on 33 counted as done");
    CHECK(msh_pool_free(pool, r, 22) == 0);
    CHECK(msh_pool_free(pool, g1, 22) == 0);
    CHECK(msh_pool_free(pool, g2, 22) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_events == 0 && f->misuse == 0);
    free(f);
}

/* While a job releases a cached handle without the pool's lock, that handle is still on the device:
 * another thread's request that needs its room waits for the release to be published, instead of
 * creating a handle at once (the device would hold a page over the limit for a moment). The fake
 * device starts the other thread's request from inside the release and gives it 300 ms; found by
 * test_spill's threads at 1 run in 30 (a page over the limit during a return's release_cached). */
static struct { struct msh_pool *pool; pthread_mutex_t m; pthread_cond_t cv; int done, rc; size_t size; uint64_t addr; pthread_t th; } rel;

static void *rel_alloc_main(void *arg)
{
    (void)arg;
    int rc = msh_pool_alloc(rel.pool, rel.size, 1, &rel.addr);
    pthread_mutex_lock(&rel.m);
    rel.rc = rc;
    rel.done = 1;
    pthread_cond_signal(&rel.cv);
    pthread_mutex_unlock(&rel.m);
    return NULL;
}

static void rel_start_alloc(struct fake *f)
{
    (void)f;
    REQUIRE(pthread_create(&rel.th, NULL, rel_alloc_main, NULL) == 0);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 300 * 1000 * 1000;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&rel.m);
    while (!rel.done && pthread_cond_timedwait(&rel.cv, &rel.m, &until) == 0) {
    }
    pthread_mutex_unlock(&rel.m);
}

TEST(a_request_waits_for_the_room_a_release_in_flight_gives_and_the_device_stays_at_the_limit)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 10 * MiB, true, 0); /* 5 pages */
    REQUIRE(pool);
    uint64_t a[4];
    for (int i = 0; i < 4; i++) REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &a[i]) == 0);
    CHECK(msh_pool_free(pool, a[1], 1) == 0); /* a 2 MiB hole, its page cached: 4 pages held */
    CHECK(f->live_bytes == 8 * MiB);
    rel.pool = pool;
    rel.done = 0;
    rel.size = 4 * MiB; /* no hole fits it: 2 new pages at the end of the line, 1 page of room now */
    pthread_mutex_init(&rel.m, NULL);
    pthread_cond_init(&rel.cv, NULL);
    f->on_release = rel_start_alloc;
    msh_pool_empty_cache(pool); /* releases a[1]'s page; another thread asks for 2 pages meanwhile */
    REQUIRE(f->on_release == NULL);
    pthread_join(rel.th, NULL);
    CHECKF(rel.rc == 0, "the request failed (%d): it should have waited for the room", rel.rc);
    CHECKF(f->peak_bytes <= 10 * MiB, "the device held %zu MiB at a limit of 10 MiB", f->peak_bytes / MiB);
    char why[256];
    CHECKF(msh_pool_check(pool, why, sizeof why) == 0, "%s", why);
    if (!rel.rc) CHECK(msh_pool_free(pool, rel.addr, 1) == 0);
    for (int i = 0; i < 4; i++)
        if (i != 1) CHECK(msh_pool_free(pool, a[i], 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    pthread_cond_destroy(&rel.cv);
    pthread_mutex_destroy(&rel.m);
    free(f);
}

/* ---- fault injection --------------------------------------------------------------------------- */

struct wl_result { long calls[OP_N]; int ok, fail, einval, other_err; int bad_rc; int unmapped_live; int overlap; int acct; };

/* Pages of every live block are mapped on the fake device; handles agree with the pool. */
static void check_consistent(struct msh_pool *pool, struct fake *f, struct wl_result *res)
{
    static struct live_set ls;
    ls.n = 0;
    msh_pool_for_each_live(pool, live_cb, &ls);
    for (int i = 0; i < ls.n; i++) {
        uint64_t end = ls.addr[i] + (ls.size[i] ? ls.size[i] : 1);
        for (uint64_t p = ls.addr[i] / GRAN; p <= (end - 1) / GRAN; p++)
            if (!fake_is_mapped(f, p * GRAN)) res->unmapped_live++;
    }
    res->overlap += overlaps(pool, NULL);
    if (msh_pool_mapped_bytes(pool) != f->live_bytes) res->acct++;
}

static struct msh_pool *wl_gc_pool;
static uint64_t wl_gc_victim;
static size_t wl_gc(void *arg)
{
    (void)arg;
    if (!wl_gc_victim) return 0;
    uint64_t v = wl_gc_victim;
    wl_gc_victim = 0;
    return msh_pool_free(wl_gc_pool, v, MSH_STREAM_COMPLETED) == 0 ? 1 : 0;
}

/* A small workload under pressure: 6-page limit, defrag, streams, GC, empty cache. */
static void workload(struct fake *f, struct msh_pool *pool, struct wl_result *res)
{
    uint64_t held[12] = {0};
    uint32_t r = 2024;
    wl_gc_pool = pool;
    msh_pool_set_gc(pool, wl_gc, NULL);
    for (int op = 0; op < 160; op++) {
        uint32_t x = rng_next(&r);
        int slot = (int)(x % 12);
        if (held[slot]) {
            uint64_t st = (x >> 8) % 3 == 0 ? MSH_STREAM_COMPLETED : 1 + (x >> 8) % 3;
            if (msh_pool_free(pool, held[slot], st)) res->bad_rc++;
            held[slot] = 0;
        } else {
            size_t sz = (x >> 4) % 4 == 0 ? 512 + (x >> 6) % (5 * MiB) : 1 + (x >> 6) % (600 * 1024);
            uint64_t st = (x >> 10) % 4 == 0 ? MSH_STREAM_COMPLETED : 1 + (x >> 11) % 3;
            uint64_t a = 0;
            int rc = msh_pool_alloc(pool, sz, st, &a);
            if (rc == 0) {
                res->ok++;
                held[slot] = a;
                if ((x >> 13) % 5 == 0) msh_pool_record_stream(pool, a, 3);
            } else if (rc == ENOMEM) {
                res->fail++;
            } else if (rc == EINVAL) {
                res->einval++;
            } else {
                res->other_err++;
            }
        }
        if (op % 40 == 39) msh_pool_empty_cache(pool);
        if (op % 17 == 0 && !wl_gc_victim) {
            for (int i = 0; i < 12; i++)
                if (held[i]) { wl_gc_victim = held[i]; held[i] = 0; break; }
        }
        check_consistent(pool, f, res);
    }
    if (wl_gc_victim && msh_pool_free(pool, wl_gc_victim, 1)) res->bad_rc++;
    wl_gc_victim = 0;
    /* free half, keep half live into destroy (destroy must release them too) */
    for (int i = 0; i < 12; i += 2)
        if (held[i] && msh_pool_free(pool, held[i], 2)) res->bad_rc++;
    check_consistent(pool, f, res);
    memcpy(res->calls, f->calls, sizeof res->calls);
}

TEST(driver_calls_are_counted_by_kind_as_the_device_sees_them)
{
    /* issue 10: the per-kind counts behind --json driver_calls must be what the device saw */
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 12 * MiB, true, 0);
    REQUIRE(pool);
    struct wl_result r;
    memset(&r, 0, sizeof r);
    workload(f, pool, &r);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.drv_calls[MSH_DRV_CREATE] == (uint64_t)f->calls[OP_CREATE]);
    CHECK(s.drv_calls[MSH_DRV_RELEASE] == (uint64_t)f->calls[OP_RELEASE]);
    CHECK(s.drv_calls[MSH_DRV_MAP] == (uint64_t)f->calls[OP_MAP]);
    CHECK(s.drv_calls[MSH_DRV_SET_ACCESS] == (uint64_t)f->calls[OP_ACCESS]);
    CHECK(s.drv_calls[MSH_DRV_SET_ACCESS] <= s.drv_calls[MSH_DRV_MAP]); /* one per block mapped */
    CHECK(s.drv_calls[MSH_DRV_UNMAP] == (uint64_t)f->calls[OP_UNMAP]);
    CHECK(s.drv_calls[MSH_DRV_SYNCHRONIZE] == (uint64_t)f->calls[OP_SYNC]);
    CHECK(s.drv_calls[MSH_DRV_EVENT_RECORD] == (uint64_t)f->calls[OP_EVREC]);
    CHECK(s.drv_calls[MSH_DRV_STREAM_WAIT] == (uint64_t)f->calls[OP_WAIT]);
    CHECK(s.drv_calls[MSH_DRV_RESERVE] == (uint64_t)f->nresv); /* the fake logs reserves, counts none */
    CHECK(s.drv_bytes[MSH_DRV_MAP] == f->bytes[OP_MAP] && s.drv_bytes[MSH_DRV_CREATE] == f->bytes[OP_CREATE]);
    CHECK(s.drv_bytes[MSH_DRV_RELEASE] == f->bytes[OP_RELEASE] && s.drv_bytes[MSH_DRV_UNMAP] == f->bytes[OP_UNMAP]);
    CHECK(s.drv_bytes[MSH_DRV_SET_ACCESS] == f->bytes[OP_ACCESS]);
    CHECK(s.drv_calls[MSH_DRV_CREATE] > 0 && s.drv_calls[MSH_DRV_UNMAP] > 0 && s.drv_calls[MSH_DRV_EVENT_RECORD] > 0);
    CHECK(s.drv_calls[MSH_DRV_MALLOC] == 0 && s.drv_calls[MSH_DRV_FREE] == 0);
    CHECK(strcmp(msh_drv_call_names[MSH_DRV_SET_ACCESS], "set_access") == 0);
    msh_pool_destroy(pool);
    free(f);
}

TEST(fault_injection_create_map_unmap_every_nth_call)
{
    /* a clean run gives the number of calls of each kind */
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 12 * MiB, true, 0);
    REQUIRE(pool);
    struct wl_result clean;
    memset(&clean, 0, sizeof clean);
    workload(f, pool, &clean);
    CHECK(clean.unmapped_live == 0 && clean.overlap == 0 && clean.acct == 0 && clean.bad_rc == 0);
    CHECK(clean.other_err == 0 && clean.einval == 0);
    struct msh_pool_stats cs = stats(pool);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->live_resv == 0 && f->live_events == 0);
    CHECK(f->misuse == 0);
    printf("    clean workload: %d allocs ok, %d ENOMEM; create %ld map %ld unmap %ld sync %ld; "
           "reclaimed %llu, rescue gc %llu, empty-cache %llu\n",
           clean.ok, clean.fail, clean.calls[OP_CREATE], clean.calls[OP_MAP], clean.calls[OP_UNMAP],
           clean.calls[OP_SYNC], (unsigned long long)cs.reclaimed_pages,
           (unsigned long long)cs.rescue_gc, (unsigned long long)cs.rescue_empty_cache);
    CHECK(clean.calls[OP_CREATE] > 0 && clean.calls[OP_MAP] > 0 && clean.calls[OP_UNMAP] > 0);
    CHECK(cs.reclaimed_pages > 0);
    free(f);

    static const enum fk_op kinds[] = {OP_CREATE, OP_MAP, OP_UNMAP, OP_SYNC, OP_EVREC, OP_WAIT, OP_ACCESS, OP_EVCREATE, OP_RELEASE};
    static const int errs[] = {ENOMEM, EIO, EIO, EIO, EIO, EIO, EIO, EIO, EIO};
    int runs = 0, bad = 0, errs_seen = 0, ok_runs = 0;
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        int kind_errs = 0;
        for (long n = 1; n <= clean.calls[kinds[k]]; n++) {
            f = fake_new(0, 0);
            pool = mk_pool(&f->dev, 12 * MiB, true, 0);
            REQUIRE(pool);
            fake_fail_nth(f, kinds[k], n, errs[k]);
            struct wl_result res;
            memset(&res, 0, sizeof res);
            workload(f, pool, &res);
            msh_pool_destroy(pool);
            runs++;
            errs_seen += res.other_err;
            kind_errs += res.other_err;
            ok_runs += f->failures == 0;
            bool fine = res.unmapped_live == 0 && res.overlap == 0 && res.acct == 0 && res.bad_rc == 0 &&
                        res.einval == 0 && f->live_handles == 0 && f->live_maps == 0 &&
                        f->live_resv == 0 && f->live_events == 0 && f->misuse == 0;
            if (!fine) {
                bad++;
                if (bad <= 5)
                    fprintf(stderr,
                            "    fail %c at call %ld: unmapped-live %d overlap %d acct %d bad-rc %d "
                            "einval %d; after destroy: handles %ld maps %ld resv %ld events %ld misuse %ld\n",
                            fk_code[kinds[k]], n, res.unmapped_live, res.overlap, res.acct, res.bad_rc,
                            res.einval, f->live_handles, f->live_maps, f->live_resv, f->live_events,
                            f->misuse);
            }
            free(f);
        }
        printf("    fail %c at each of its %ld calls: %d allocs returned an error other than ENOMEM\n",
               fk_code[kinds[k]], clean.calls[kinds[k]], kind_errs);
    }
    printf("    %d fault-injection runs (create/map/unmap/sync/event/wait/access/event create/release), %d inconsistent, "
           "%d allocs failed with a non-ENOMEM error, %d runs where the N-th call never came\n",
           runs, bad, errs_seen, ok_runs);
    CHECK(bad == 0);
}

/* ---- threads, several pools, steady state --------------------------------------------------- */

struct wk_arg {
    struct msh_pool *pool;
    pthread_barrier_t *bar;
    int id;
    long ops, fails;
    size_t held_bytes;
    int held_n;
};

static void *worker_main(void *p)
{
    struct wk_arg *t = p;
    uint64_t held[64] = {0};
    size_t hsz[64] = {0};
    uint32_t r = 0x9e3779b9u * (uint32_t)(t->id + 1);
    for (int i = 0; i < 20000; i++) {
        uint32_t x = rng_next(&r);
        int slot = (int)(x % 64);
        uint64_t st = 100 + (uint64_t)t->id;
        if (held[slot]) {
            if (msh_pool_free(t->pool, held[slot], (x >> 7) & 1 ? st : MSH_STREAM_COMPLETED)) t->fails++;
            held[slot] = 0;
        } else {
            size_t sz = (x >> 6) % 16 == 0 ? MiB + (x >> 10) % (20 * MiB) : (x >> 10) % (256 * 1024);
            if (msh_pool_alloc(t->pool, sz, st, &held[slot])) {
                t->fails++;
                held[slot] = 0;
            } else {
                hsz[slot] = sz;
            }
        }
        t->ops++;
    }
    t->held_bytes = 0;
    t->held_n = 0;
    for (int i = 0; i < 64; i++)
        if (held[i]) {
            t->held_bytes += hsz[i];
            t->held_n++;
        }
    pthread_barrier_wait(t->bar); /* main checks the live set here */
    pthread_barrier_wait(t->bar);
    for (int i = 0; i < 64; i++)
        if (held[i] && msh_pool_free(t->pool, held[i], MSH_STREAM_COMPLETED)) t->fails++;
    return NULL;
}

TEST(eight_threads_on_the_sim_device)
{
    struct msh_device d;
    REQUIRE(msh_dev_sim_init(&d, 0, GRAN) == 0);
    struct msh_pool *pool = mk_pool(&d, 0, true, 0);
    REQUIRE(pool);
    enum { NT = 8 };
    pthread_t th[NT];
    struct wk_arg a[NT];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, NT + 1);
    for (int i = 0; i < NT; i++) {
        a[i] = (struct wk_arg){.pool = pool, .bar = &bar, .id = i};
        REQUIRE(pthread_create(&th[i], NULL, worker_main, &a[i]) == 0);
    }
    pthread_barrier_wait(&bar);
    int n = 0;
    CHECK(overlaps(pool, &n) == 0);
    size_t bytes = 0;
    int held = 0;
    for (int i = 0; i < NT; i++) {
        bytes += a[i].held_bytes;
        held += a[i].held_n;
    }
    struct msh_pool_stats s = stats(pool);
    CHECK(n == held && s.live_blocks == (size_t)held && s.live_bytes == bytes);
    CHECK(s.mapped_bytes >= s.touched_bytes && s.touched_bytes >= bytes);
    pthread_barrier_wait(&bar);
    long ops = 0, fails = 0;
    for (int i = 0; i < NT; i++) {
        pthread_join(th[i], NULL);
        ops += a[i].ops;
        fails += a[i].fails;
    }
    s = stats(pool);
    CHECK(fails == 0);
    CHECK(s.live_bytes == 0 && s.live_blocks == 0 && s.touched_bytes == 0);
    CHECK(s.allocs == s.frees);
    CHECK(s.allocs + s.frees == (uint64_t)ops + (uint64_t)held);
    CHECK(s.mapped_bytes == s.drv_bytes[MSH_DRV_CREATE] - s.drv_bytes[MSH_DRV_RELEASE]);
    printf("    %d threads, %ld ops, %llu allocs, peak live %zu MiB, peak mapped %zu MiB\n", NT, ops,
           (unsigned long long)s.allocs, s.peak_live_bytes >> 20, s.peak_mapped_bytes >> 20);
    pthread_barrier_destroy(&bar);
    msh_pool_destroy(pool);
    msh_dev_sim_fini(&d);
}

TEST(two_pools_keep_separate_accounting)
{
    struct msh_device d;
    REQUIRE(msh_dev_sim_init(&d, 0, GRAN) == 0);
    struct fake *f = fake_new(0, (uint64_t)1 << 45);
    struct msh_pool *p1 = mk_pool(&d, 0, true, 0), *p2 = mk_pool(&f->dev, 16 * MiB, true, 0);
    REQUIRE(p1 && p2);
    uint64_t a, b, c;
    REQUIRE(msh_pool_alloc(p1, 5 * MiB, 1, &a) == 0);
    REQUIRE(msh_pool_alloc(p2, 3 * MiB, 1, &b) == 0);
    REQUIRE(msh_pool_alloc(p2, 1000, 1, &c) == 0);
    struct msh_pool_stats s1 = stats(p1), s2 = stats(p2);
    CHECK(s1.live_bytes == 5 * MiB && s1.live_blocks == 1 && s1.mapped_bytes == 3 * GRAN);
    CHECK(s2.live_bytes == 3 * MiB + 1000 && s2.live_blocks == 2 && s2.mapped_bytes == 3 * GRAN);
    CHECK(msh_pool_owns(p1, a) && !msh_pool_owns(p2, a) && msh_pool_owns(p2, b) && !msh_pool_owns(p1, b));
    CHECK(msh_pool_free(p1, b, 1) == EINVAL); /* another pool's block */
    CHECK(msh_pool_free(p2, a, 1) == EINVAL);
    CHECK(msh_pool_free(p1, a, 1) == 0);
    s1 = stats(p1);
    s2 = stats(p2);
    CHECK(s1.live_bytes == 0 && s2.live_bytes == 3 * MiB + 1000);
    CHECK(msh_pool_empty_cache(p1) == 3 * GRAN);
    CHECK(stats(p2).mapped_bytes == 3 * GRAN);
    CHECK(f->live_handles == 3);
    msh_pool_destroy(p1);
    CHECK(msh_pool_block_size(p2, b) == 3 * MiB);
    msh_pool_destroy(p2);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
    msh_dev_sim_fini(&d);
}

TEST(steady_state_second_round_maps_nothing)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    enum { N = 2000 };
    static uint64_t held[128];
    struct msh_pool_stats s[2];
    for (int round = 0; round < 2; round++) {
        memset(held, 0, sizeof held);
        uint32_t r = 4242;
        for (int i = 0; i < N; i++) {
            uint32_t x = rng_next(&r);
            int slot = (int)(x % 128);
            if (held[slot]) {
                CHECK(msh_pool_free(pool, held[slot], 1 + (x >> 9) % 2) == 0);
                held[slot] = 0;
            } else {
                size_t sz = (x >> 7) % 10 == 0 ? MiB + (x >> 11) % (50 * MiB) : 1 + (x >> 11) % MiB;
                CHECK(msh_pool_alloc(pool, sz, 1 + (x >> 9) % 2, &held[slot]) == 0);
            }
        }
        for (int i = 0; i < 128; i++)
            if (held[i]) CHECK(msh_pool_free(pool, held[i], 1) == 0);
        s[round] = stats(pool);
    }
    CHECK(s[0].map_ops > 0);
    CHECKF(s[1].map_ops == s[0].map_ops && s[1].unmap_ops == s[0].unmap_ops &&
               s[1].create_ops == s[0].create_ops,
           "round 2 did %llu maps, %llu unmaps", (unsigned long long)(s[1].map_ops - s[0].map_ops),
           (unsigned long long)(s[1].unmap_ops - s[0].unmap_ops));
    CHECK(s[1].peak_mapped_bytes == s[0].peak_mapped_bytes);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* ---- handles, access, chunks (issue 10: fewer driver calls) -------------------------------------- */

TEST(one_handle_for_the_pages_a_block_covers_whole_and_one_access_grant)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0); /* no limit: far from any */
    REQUIRE(pool);
    uint64_t a;
    /* 10 MiB + 512 from a page boundary: five whole pages and a sixth touched in part */
    REQUIRE(msh_pool_alloc(pool, 10 * MiB + 512, 1, &a) == 0);
    CHECK(a % GRAN == 0);
    CHECK(f->calls[OP_CREATE] == 2 && f->calls[OP_MAP] == 2 && f->calls[OP_ACCESS] == 1);
    int c = fake_log_find(f, 'C', 0), acc = fake_log_find(f, 'A', 0);
    REQUIRE(c >= 0 && acc >= 0);
    CHECK(f->log[c].a == 5 * GRAN);                 /* the interior: one handle */
    CHECK(f->log[acc].a == a && f->log[acc].b == 6 * GRAN); /* access once, over both */
    for (uint64_t p = a / GRAN; p <= (a + 10 * MiB) / GRAN; p++) CHECK(fake_is_mapped(f, p * GRAN));
    struct msh_pool_stats s = stats(pool);
    CHECK(s.handles == 2 && s.mapped_bytes == 6 * GRAN && s.create_ops == 2);
    CHECK(s.drv_calls[MSH_DRV_SET_ACCESS] == 1 && s.drv_bytes[MSH_DRV_CREATE] == 6 * GRAN);
    /* the grant covers two mappings, which the driver pays for each (drvcost.h) */
    CHECK(s.drv_maps[MSH_DRV_SET_ACCESS] == 2 && s.drv_maps[MSH_DRV_CREATE] == 2 && s.drv_maps[MSH_DRV_MAP] == 2);
    CHECK(msh_pool_free(pool, a, 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(at_the_limit_every_page_is_a_handle_of_its_own)
{
    /* issue 15: under a limit a page can be given back alone only if it is a handle alone (the
     * page model), so the same block maps six one-page handles there, with one access grant */
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 64 * MiB, true, 0);
    REQUIRE(pool);
    uint64_t a;
    REQUIRE(msh_pool_alloc(pool, 10 * MiB + 512, 1, &a) == 0);
    CHECK(f->calls[OP_CREATE] == 6 && f->calls[OP_MAP] == 6 && f->calls[OP_ACCESS] == 1);
    for (int i = 0; i < f->nlog; i++)
        if (f->log[i].op == 'C') CHECK(f->log[i].a == GRAN);
    CHECK(stats(pool).handles == 6);
    CHECK(msh_pool_free(pool, a, 1) == 0);
    /* the same without a limit but near the device's capacity (3/4 of it held): pages too */
    msh_pool_destroy(pool);
    free(f);
    f = fake_new(16 * MiB, 0);
    REQUIRE((pool = mk_pool(&f->dev, 0, true, 0)));
    REQUIRE(msh_pool_alloc(pool, 10 * MiB + 512, 1, &a) == 0); /* 6 + 1 > 3/4 of 8 pages */
    CHECK(f->calls[OP_CREATE] == 6 && stats(pool).handles == 6);
    CHECK(msh_pool_free(pool, a, 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* A pool under a limit that can change (struct msh_pool_share, as shim/torch.c's pools have): a
 * test makes handles far from any limit, then sets one. */
static struct msh_pool *mk_pool_shared(struct msh_device *d, struct msh_pool_share *sh)
{
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.ahead_bytes = GRAN;
    p.plan_sync = true;
    p.va_bytes = 8 * GiB;
    p.share = sh;
    struct msh_pool *pool = NULL;
    if (msh_pool_create(d, &p, &pool)) return NULL;
    return pool;
}

TEST(a_cached_handle_used_in_part_is_repartitioned_so_nothing_is_stranded)
{
    /* A's five pages share a handle (made far from any limit). When, under a limit, B takes only
     * the first page and a half of it, a handle left whole would keep the other three pages
     * unreclaimable while B lives (stranded), and D below would not fit in the 7-page limit. The
     * pool re-partitions the cached handle instead: B's pages and the rest become handles of
     * their own, the rest stays cached and reclaimable. */
    struct fake *f = fake_new(0, 0);
    struct msh_pool_share sh = {0};
    struct msh_pool *pool = mk_pool_shared(&f->dev, &sh);
    REQUIRE(pool);
    uint64_t a, g, b, d;
    REQUIRE(msh_pool_alloc(pool, 10 * MiB, 1, &a) == 0); /* pages 0-4, one handle */
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &g) == 0);  /* page 5: bounds A's extent */
    CHECK(stats(pool).handles == 2);
    CHECK(msh_pool_free(pool, a, 1) == 0);
    __atomic_store_n(&sh.limit_bytes, 14 * MiB, __ATOMIC_RELAXED);
    fake_log_clear(f);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB + 4096, 1, &b) == 0);
    CHECK(b == a);
    struct msh_pool_stats s = stats(pool);
    CHECK(fake_log_count(f, 'U') == 1 && fake_log_count(f, 'R') == 1); /* the 5-page handle */
    CHECK(s.mapped_bytes == 6 * GRAN && s.handles == 4);               /* [0] [1] [2-4] + g */
    CHECK(s.touched_bytes == 3 * GRAN);
    REQUIRE(msh_pool_alloc(pool, 8 * MiB, 1, &d) == 0); /* 4 pages after g: reclaims [2-4] */
    s = stats(pool);
    CHECK(s.reclaimed_pages == 3 && s.mapped_bytes == 7 * GRAN);
    for (uint64_t p = d / GRAN; p < (d + 8 * MiB) / GRAN; p++) CHECK(fake_is_mapped(f, p * GRAN));
    char why[256];
    CHECKF(msh_pool_check(pool, why, sizeof why) == 0, "%s", why);
    CHECK(msh_pool_free(pool, b, 1) == 0);
    CHECK(msh_pool_free(pool, d, 1) == 0);
    CHECK(msh_pool_free(pool, g, 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(a_split_handle_leaves_out_the_pages_it_has_no_room_for)
{
    /* issue 15: a 5-page handle at pages 1-5 (made far from any limit), page 0 unmapped, then a
     * limit of 5 pages. B covers pages 0-2 whole and page 3 in part: with one handle per page it
     * needs page 0 only, and reclaims a cached page for it. Splitting the handle made B's four
     * handles and kept pages 4-5 as a fifth: 6 pages where 5 may be held, and the request failed.
     * The pages beside B are left out (the farthest first) until it fits. */
    struct fake *f = fake_new(0, 0);
    struct msh_pool_share sh = {0};
    struct msh_pool *pool = mk_pool_shared(&f->dev, &sh);
    REQUIRE(pool);
    uint64_t p, a, b;
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &p) == 0);  /* page 0 */
    REQUIRE(msh_pool_alloc(pool, 10 * MiB, 1, &a) == 0); /* pages 1-5, one handle */
    CHECK(a == p + GRAN && stats(pool).handles == 2);
    CHECK(msh_pool_free(pool, p, 1) == 0);
    CHECK(msh_pool_empty_cache(pool) == GRAN); /* page 0 goes back; A is live */
    CHECK(msh_pool_free(pool, a, 1) == 0);
    __atomic_store_n(&sh.limit_bytes, 10 * MiB, __ATOMIC_RELAXED);
    fake_log_clear(f);
    CHECK(msh_pool_alloc(pool, 7 * MiB + 4096, 1, &b) == 0);
    CHECK(b == p);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.mapped_bytes == 5 * GRAN && s.touched_bytes == 4 * GRAN && sh.handle_bytes == 10 * MiB);
    CHECK(fake_is_mapped(f, p + 4 * GRAN) && !fake_is_mapped(f, p + 5 * GRAN)); /* one page left out */
    CHECK(s.reclaimed_pages == 1);
    char why[256];
    CHECKF(msh_pool_check(pool, why, sizeof why) == 0, "%s", why);
    CHECK(msh_pool_free(pool, b, 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(far_from_any_limit_the_open_end_is_mapped_in_chunks)
{
    /* no limit: a 3 MiB block at the open end of the line maps a 20 MiB chunk; the next blocks
     * placed there need no driver call; the chunk's unused tail is all that is held beyond them */
    struct fake *f = fake_new(0, 0);
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.va_bytes = 8 * GiB;
    struct msh_pool *pool = NULL;
    REQUIRE(msh_pool_create(&f->dev, &p, &pool) == 0);
    uint64_t a[5];
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 1, &a[0]) == 0);
    CHECK(f->calls[OP_CREATE] == 1 && f->bytes[OP_CREATE] == 20 * MiB && f->calls[OP_ACCESS] == 1);
    long calls = f->nlog;
    for (int i = 1; i < 5; i++) REQUIRE(msh_pool_alloc(pool, 4 * MiB, 1, &a[i]) == 0);
    CHECK(f->nlog == calls); /* 3 + 16 MiB: inside the chunk */
    for (int i = 0; i < 5; i++) CHECK(msh_pool_free(pool, a[i], 1) == 0);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.peak_mapped_bytes == 20 * MiB && s.handles == 1);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

TEST(pools_sharing_a_limit_never_hold_more_than_it_together)
{
    /* shim/torch.c's capture pools share the main pool's limit (struct msh_pool_share) */
    struct fake *f = fake_new(0, 0);
    struct msh_pool_share sh = {.limit_bytes = 20 * MiB};
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.va_bytes = 8 * GiB;
    p.limit_bytes = 2 * GiB; /* ignored: the share's limit applies */
    p.share = &sh;
    struct msh_pool *a = NULL, *b = NULL;
    REQUIRE(msh_pool_create(&f->dev, &p, &a) == 0 && msh_pool_create(&f->dev, &p, &b) == 0);
    uint64_t x, y, z;
    REQUIRE(msh_pool_alloc(a, 12 * MiB, 1, &x) == 0);
    CHECK(sh.handle_bytes == 12 * MiB);
    CHECK(msh_pool_alloc(b, 10 * MiB, 1, &y) == ENOMEM); /* 12 + 10 > 20 */
    REQUIRE(msh_pool_alloc(b, 8 * MiB, 1, &y) == 0);
    CHECK(sh.handle_bytes == 20 * MiB);
    CHECK(msh_pool_free(a, x, 1) == 0);
    CHECK(msh_pool_alloc(b, 8 * MiB, 1, &z) == ENOMEM); /* a's pages are cached in a */
    CHECK(msh_pool_empty_cache(a) == 12 * MiB);
    CHECK(sh.handle_bytes == 8 * MiB);
    REQUIRE(msh_pool_alloc(b, 8 * MiB, 1, &z) == 0);
    CHECK(sh.handle_bytes == 16 * MiB);
    CHECK(msh_pool_free(b, y, 1) == 0 && msh_pool_free(b, z, 1) == 0);
    msh_pool_destroy(a);
    msh_pool_destroy(b);
    CHECK(sh.handle_bytes == 0);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* ---- the learned step (issue 10: steady state at tight capacity) ---------------------------------- */

/* One step whose best-fit placement needs six pages over time although at most four are touched
 * at once (so a 4-page pool remaps every step), padded with small requests to the length a step
 * must have to be learned. Returns the allocations that failed. */
static int churn_step(struct msh_pool *pool, size_t big)
{
    int fails = 0;
    uint64_t a, b, c, sm[20];
    fails += msh_pool_alloc(pool, 4 * MiB, 1, &a) != 0;
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &b) != 0;
    for (int i = 0; i < 20; i++) fails += msh_pool_alloc(pool, 64 * 1024, 1, &sm[i]) != 0;
    for (int i = 0; i < 20; i++) msh_pool_free(pool, sm[i], 1);
    msh_pool_free(pool, a, 1);
    fails += msh_pool_alloc(pool, big, 1, &c) != 0; /* does not fit where a was */
    msh_pool_free(pool, b, 1);
    msh_pool_free(pool, c, 1);
    return fails;
}

TEST(a_repeated_step_that_remaps_is_learned_and_then_maps_nothing)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 10 * MiB, true, 0); /* 4 large pages + 1 small */
    REQUIRE(pool);
    long maps[8], unmaps[8];
    int fails = 0;
    for (int step = 0; step < 8; step++) {
        long m0 = f->calls[OP_MAP], u0 = f->calls[OP_UNMAP];
        fails += churn_step(pool, 6 * MiB);
        maps[step] = f->calls[OP_MAP] - m0;
        unmaps[step] = f->calls[OP_UNMAP] - u0;
    }
    CHECK(fails == 0);
    struct msh_pool_stats s = stats(pool);
    printf("    map/unmap per step:");
    for (int i = 0; i < 8; i++) printf(" %ld/%ld", maps[i], unmaps[i]);
    printf("; plans %llu, placed %llu, dropped %llu\n", (unsigned long long)s.plans_built,
           (unsigned long long)s.plan_placed, (unsigned long long)s.plan_dropped);
    CHECK(unmaps[0] > 0);             /* online, the step remaps */
    CHECK(s.plans_built == 1 && s.plan_dropped == 0);
    for (int i = 2; i < 8; i++) CHECKF(maps[i] == 0 && unmaps[i] == 0, "step %d: %ld maps, %ld unmaps", i, maps[i], unmaps[i]);
    /* the step changes: the plan is dropped, placement is best fit again, nothing fails */
    fails = churn_step(pool, 5 * MiB);
    s = stats(pool);
    CHECK(fails == 0 && s.plan_dropped == 1);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);

    /* without learning (no_learn), the same steps remap every time: what the plan removes */
    f = fake_new(0, 0);
    struct msh_pool_params p;
    msh_pool_params_default(&p);
    p.va_bytes = 8 * GiB;
    p.ahead_bytes = GRAN;
    p.limit_bytes = 10 * MiB;
    p.no_learn = true;
    REQUIRE(msh_pool_create(&f->dev, &p, &pool) == 0);
    for (int step = 0; step < 8; step++) {
        long u0 = f->calls[OP_UNMAP];
        CHECK(churn_step(pool, 6 * MiB) == 0);
        CHECKF(f->calls[OP_UNMAP] > u0, "step %d without learning did not remap", step);
    }
    msh_pool_destroy(pool);
    free(f);
}

/* churn_step with every size scaled by f (a sequence length that varies per batch: the same step,
 * other sizes), rounded to 512 bytes as the pool rounds. */
static int churn_step_scaled(struct msh_pool *pool, double f)
{
#define SCALED(x) ((size_t)((double)(x) * f) / 512 * 512)
    int fails = 0;
    uint64_t a, b, c, sm[20];
    fails += msh_pool_alloc(pool, SCALED(4 * MiB), 1, &a) != 0;
    fails += msh_pool_alloc(pool, SCALED(2 * MiB), 1, &b) != 0;
    for (int i = 0; i < 20; i++) fails += msh_pool_alloc(pool, SCALED(64 * 1024), 1, &sm[i]) != 0;
    for (int i = 0; i < 20; i++) msh_pool_free(pool, sm[i], 1);
    msh_pool_free(pool, a, 1);
    fails += msh_pool_alloc(pool, SCALED(6 * MiB), 1, &c) != 0;
    msh_pool_free(pool, b, 1);
    msh_pool_free(pool, c, 1);
    return fails;
#undef SCALED
}

/* Issue 15 item 5: a step that repeats only up to its sizes (each step's sizes scaled by its own
 * factor in [0.9, 1]) is learned: the plan of a step places the blocks of any step whose sizes are
 * within 1/8 and no larger, and a step with larger sizes leaves it and is learned in its place, so
 * the plans grow to the largest step seen. From then on nothing is mapped or unmapped. Before, no
 * two steps were the same step (sizes compared exactly), nothing was learned, and every step
 * remapped. */
TEST(a_step_whose_sizes_vary_per_step_is_learned_and_then_maps_nothing)
{
    static const double factor[16] = {0.93, 0.97, 0.91, 0.95, 1.0, 0.92, 0.96, 0.9,
                                      0.98, 0.94, 0.99, 0.915, 0.975, 0.935, 0.955, 0.905};
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 10 * MiB, true, 0);
    REQUIRE(pool);
    long maps[16], unmaps[16];
    int fails = 0;
    for (int step = 0; step < 16; step++) {
        long m0 = f->calls[OP_MAP], u0 = f->calls[OP_UNMAP];
        fails += churn_step_scaled(pool, factor[step]);
        maps[step] = f->calls[OP_MAP] - m0;
        unmaps[step] = f->calls[OP_UNMAP] - u0;
    }
    struct msh_pool_stats s = stats(pool);
    printf("    map/unmap per step:");
    for (int i = 0; i < 16; i++) printf(" %ld/%ld", maps[i], unmaps[i]);
    printf("; plans %llu, placed %llu, dropped %llu\n", (unsigned long long)s.plans_built,
           (unsigned long long)s.plan_placed, (unsigned long long)s.plan_dropped);
    CHECK(fails == 0);
    CHECK(unmaps[0] > 0); /* online, the step remaps */
    /* the step of factor 1.0 (step 4) is the largest: every step after the one after it maps nothing */
    for (int i = 6; i < 16; i++) CHECKF(maps[i] == 0 && unmaps[i] == 0, "step %d (sizes x%.2f): %ld maps, %ld unmaps", i, factor[i], maps[i], unmaps[i]);
    CHECKF(s.plan_placed >= 10 * 23, "%llu allocations placed by a plan", (unsigned long long)s.plan_placed);
    char why[256];
    CHECKF(msh_pool_check(pool, why, sizeof why) == 0, "%s", why);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* Sizes are the same step's within 1/8 only: a step whose first request is a quarter larger than
 * planned is another step. The plan is given up as one that may come back (resumable), not as a
 * step that grew, and the next step that starts as planned resumes it at once. */
TEST(a_request_a_quarter_larger_than_planned_is_another_step_and_the_plan_comes_back)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 10 * MiB, true, 0);
    REQUIRE(pool);
    int fails = 0;
    for (int step = 0; step < 4; step++) fails += churn_step(pool, 6 * MiB);
    struct msh_pool_stats s0 = stats(pool);
    CHECK(s0.plans_built == 1);
    uint64_t x;
    fails += msh_pool_alloc(pool, 5 * MiB, 1, &x) != 0; /* planned first: 4 MiB */
    msh_pool_free(pool, x, 1);
    struct msh_pool_stats s1 = stats(pool);
    CHECK(s1.plan_dropped == s0.plan_dropped + 1);
    fails += churn_step(pool, 6 * MiB);
    struct msh_pool_stats s2 = stats(pool);
    CHECKF(s2.plans_built == s1.plans_built + 1 && s2.plan_placed - s1.plan_placed == 23,
           "plans %llu -> %llu, placed %llu: the plan was not resumed", (unsigned long long)s1.plans_built,
           (unsigned long long)s2.plans_built, (unsigned long long)(s2.plan_placed - s1.plan_placed));
    CHECK(fails == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* The first `nsmall` allocations of churn_step's step (an evaluation running the step's forward
 * part), then `odd` bytes when nonzero (a step that leaves the plan), all freed at its end. */
static int partial_step(struct msh_pool *pool, int nsmall, size_t odd)
{
    int fails = 0;
    uint64_t a, b, x = 0, sm[20];
    fails += msh_pool_alloc(pool, 4 * MiB, 1, &a) != 0;
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &b) != 0;
    for (int i = 0; i < nsmall; i++) fails += msh_pool_alloc(pool, 64 * 1024, 1, &sm[i]) != 0;
    if (odd) fails += msh_pool_alloc(pool, odd, 1, &x) != 0;
    for (int i = 0; i < nsmall; i++) msh_pool_free(pool, sm[i], 1);
    if (odd) msh_pool_free(pool, x, 1);
    msh_pool_free(pool, a, 1);
    msh_pool_free(pool, b, 1);
    return fails;
}

/* Issue 15: a learned step is not lost to what runs between two of its steps. An evaluation that
 * runs the first part of the step begins the step again before its end: the plan starts over at
 * the next step (it used to be dropped there, in mid-step, for good). A step that leaves the plan
 * in mid-step (another size) drops it, and the plan is resumed when its start comes back (it used
 * to be resumed only when dropped at its own end). Both times the next step maps nothing. */
TEST(a_learned_step_survives_an_evaluation_and_a_step_that_leaves_it)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 10 * MiB, true, 0);
    REQUIRE(pool);
    int fails = 0;
    for (int step = 0; step < 4; step++) fails += churn_step(pool, 6 * MiB);
    struct msh_pool_stats s0 = stats(pool);
    CHECK(s0.plans_built == 1);
    fails += partial_step(pool, 20, 0); /* the evaluation: 22 of the step's allocations */
    long m0 = f->calls[OP_MAP], u0 = f->calls[OP_UNMAP];
    fails += churn_step(pool, 6 * MiB);
    long m1 = f->calls[OP_MAP] - m0, u1 = f->calls[OP_UNMAP] - u0;
    struct msh_pool_stats s1 = stats(pool);
    CHECKF(m1 == 0 && u1 == 0, "the step after the evaluation: %ld maps, %ld unmaps", m1, u1);
    CHECKF(s1.plan_dropped == s0.plan_dropped && s1.plan_placed - s0.plan_placed == 22 + 23, "dropped %llu -> %llu, placed %llu", (unsigned long long)s0.plan_dropped, (unsigned long long)s1.plan_dropped, (unsigned long long)(s1.plan_placed - s0.plan_placed));
    fails += partial_step(pool, 3, 3 * MiB / 2); /* leaves the plan at its sixth allocation, for mapped pages */
    struct msh_pool_stats s2 = stats(pool);
    CHECK(s2.plan_dropped == s1.plan_dropped + 1);
    m0 = f->calls[OP_MAP], u0 = f->calls[OP_UNMAP];
    fails += churn_step(pool, 6 * MiB);
    long m2 = f->calls[OP_MAP] - m0, u2 = f->calls[OP_UNMAP] - u0;
    struct msh_pool_stats s3 = stats(pool);
    CHECKF(m2 == 0 && u2 == 0, "the step after the one that left the plan: %ld maps, %ld unmaps", m2, u2);
    CHECK(s3.plans_built == s2.plans_built + 1 && s3.plan_placed - s2.plan_placed == 23); /* resumed */
    CHECK(fails == 0);
    printf("    after the evaluation %ld/%ld, after the step that left the plan %ld/%ld map/unmap; plans %llu, "
           "dropped %llu\n", m1, u1, m2, u2, (unsigned long long)s3.plans_built, (unsigned long long)s3.plan_dropped);
    char why[256];
    CHECKF(msh_pool_check(pool, why, sizeof why) == 0, "%s", why);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* A step whose large blocks take back, late in the step, the small area's only page: at the step
 * boundary the small area has nothing mapped, while the large area has room for the small blocks
 * at the time they live. Returns the allocations that failed. */
static int area_step(struct msh_pool *pool)
{
    int fails = 0;
    uint64_t a, b, c, sm[24];
    for (int i = 0; i < 24; i++) fails += msh_pool_alloc(pool, 64 * 1024, 1, &sm[i]) != 0;
    fails += msh_pool_alloc(pool, 4 * MiB, 1, &a) != 0;
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &b) != 0;
    for (int i = 0; i < 24; i++) msh_pool_free(pool, sm[i], 1);
    msh_pool_free(pool, a, 1);
    fails += msh_pool_alloc(pool, 6 * MiB, 1, &c) != 0; /* after b: reclaims the small page and a's */
    msh_pool_free(pool, b, 1);
    msh_pool_free(pool, c, 1);
    return fails;
}

/* Issue 10: from the second step on, no map and no unmap. The plan is packed into the pages
 * mapped at the step boundary only, across both areas (the small blocks go to large-area pages
 * that are free while they live), and a block the plan places shares the pages it finds. The
 * pool before this change mapped again in the second step (it packed the small blocks into the
 * small area, whose page the first step had given to the large blocks). */
TEST(the_second_step_maps_nothing_when_the_step_boundary_left_one_area_unmapped)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 10 * MiB, true, 0); /* 5 pages in all */
    REQUIRE(pool);
    long maps[6], unmaps[6];
    int fails = 0;
    for (int step = 0; step < 6; step++) {
        long m0 = f->calls[OP_MAP], u0 = f->calls[OP_UNMAP];
        fails += area_step(pool);
        maps[step] = f->calls[OP_MAP] - m0;
        unmaps[step] = f->calls[OP_UNMAP] - u0;
    }
    struct msh_pool_stats s = stats(pool);
    printf("    map/unmap per step:");
    for (int i = 0; i < 6; i++) printf(" %ld/%ld", maps[i], unmaps[i]);
    printf("; plans %llu, placed %llu, dropped %llu\n", (unsigned long long)s.plans_built,
           (unsigned long long)s.plan_placed, (unsigned long long)s.plan_dropped);
    CHECK(fails == 0);
    CHECK(unmaps[0] > 0); /* online, the step remaps */
    CHECK(s.plans_built == 1 && s.plan_dropped == 0);
    for (int i = 1; i < 6; i++) CHECKF(maps[i] == 0 && unmaps[i] == 0, "step %d: %ld maps, %ld unmaps", i + 1, maps[i], unmaps[i]);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* A step no fixed placement fits into four large pages although at most four are live at once,
 * padded with 20 small blocks that live through it (the small area's page). Z0 (2 pages), F1 and
 * F2; Z0 freed, A and B take its pages; F1 and F2 freed, Z1 (2) takes theirs; Z1 freed, C and D
 * take its pages; A and C freed, X (2) needs their pages side by side; B and D freed, Y (2) needs
 * theirs side by side. So A and B hold one half, C and D the other, A and C the middle two pages,
 * and B and D are at the two ends: no plan packs it into 4 pages, 5 are needed. Online the pool
 * remaps (X and Y each take pages that were apart). Returns the allocations that failed. */
static int unpackable_step(struct msh_pool *pool)
{
    int fails = 0;
    uint64_t z0, f1, f2, a, b, z1, c, d, x, y, sm[20];
    for (int i = 0; i < 20; i++) fails += msh_pool_alloc(pool, 64 * 1024, 1, &sm[i]) != 0;
    fails += msh_pool_alloc(pool, 4 * MiB, 1, &z0) != 0;
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &f1) != 0;
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &f2) != 0;
    msh_pool_free(pool, z0, 1);
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &a) != 0;
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &b) != 0;
    msh_pool_free(pool, f1, 1);
    msh_pool_free(pool, f2, 1);
    fails += msh_pool_alloc(pool, 4 * MiB, 1, &z1) != 0;
    msh_pool_free(pool, z1, 1);
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &c) != 0;
    fails += msh_pool_alloc(pool, 2 * MiB, 1, &d) != 0;
    msh_pool_free(pool, a, 1);
    msh_pool_free(pool, c, 1);
    fails += msh_pool_alloc(pool, 4 * MiB, 1, &x) != 0;
    msh_pool_free(pool, b, 1);
    msh_pool_free(pool, d, 1);
    fails += msh_pool_alloc(pool, 4 * MiB, 1, &y) != 0;
    msh_pool_free(pool, x, 1);
    msh_pool_free(pool, y, 1);
    for (int i = 0; i < 20; i++) msh_pool_free(pool, sm[i], 1);
    return fails;
}

/* A step that did not pack into the limit is not tried again at that limit for a while (the
 * back-off), but a limit raised (set_per_process_memory_fraction, a capture pool's memory given
 * back) is a new budget: the step repeats, is learned at once and maps nothing from then on. */
TEST(a_step_that_did_not_pack_is_learned_at_once_when_the_limit_rises)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool_share sh = {.limit_bytes = 10 * MiB}; /* 4 large pages + 1 small */
    struct msh_pool *pool = mk_pool_shared(&f->dev, &sh);
    REQUIRE(pool);
    int fails = 0;
    long u0 = f->calls[OP_UNMAP];
    for (int step = 0; step < 6; step++) fails += unpackable_step(pool);
    struct msh_pool_stats s = stats(pool);
    CHECKF(fails == 0, "%d allocations failed under the 10 MiB limit", fails);
    CHECKF(f->calls[OP_UNMAP] - u0 >= 6, "the steps did not remap (%ld unmaps): the test proves nothing", f->calls[OP_UNMAP] - u0);
    CHECKF(s.plans_built == 0, "%llu plans built: the step packed into 4 large pages", (unsigned long long)s.plans_built);
    CHECKF(s.plan_failed == 1, "%llu packings failed under 10 MiB (1: tried once, then the back-off)", (unsigned long long)s.plan_failed);
    __atomic_store_n(&sh.limit_bytes, 12 * MiB, __ATOMIC_RELAXED);
    long maps[4], unmaps[4];
    for (int step = 0; step < 4; step++) {
        long m1 = f->calls[OP_MAP], u1 = f->calls[OP_UNMAP];
        fails += unpackable_step(pool);
        maps[step] = f->calls[OP_MAP] - m1;
        unmaps[step] = f->calls[OP_UNMAP] - u1;
    }
    s = stats(pool);
    printf("    under 12 MiB, map/unmap per step: %ld/%ld %ld/%ld %ld/%ld %ld/%ld; plans %llu\n", maps[0], unmaps[0],
           maps[1], unmaps[1], maps[2], unmaps[2], maps[3], unmaps[3], (unsigned long long)s.plans_built);
    CHECK(fails == 0);
    CHECKF(s.plans_built == 1 && s.plan_failed == 1, "%llu plans built after the limit rose (%llu failed)",
           (unsigned long long)s.plans_built, (unsigned long long)s.plan_failed);
    for (int i = 2; i < 4; i++) CHECKF(maps[i] == 0 && unmaps[i] == 0, "step %d under 12 MiB: %ld maps, %ld unmaps", i + 1, maps[i], unmaps[i]);
    char why[256];
    CHECKF(msh_pool_check(pool, why, sizeof why) == 0, "%s", why);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* The back-off after a step that did not pack grows: the same step at the same budget waits 64,
 * 128, 256, 512 step lengths, then 1024 each time (docs/pool.md), so a job whose step never fits
 * pays a packing about once per thousand steps, not once per 64. It used to stay at 64: the count
 * of failures was reset at every failure. */
TEST(the_back_off_after_a_step_that_does_not_pack_grows)
{
    struct fake *f = fake_new(0, 0);
    struct msh_pool_share sh = {.limit_bytes = 10 * MiB};
    struct msh_pool *pool = mk_pool_shared(&f->dev, &sh);
    REQUIRE(pool);
    int fails = 0;
    uint64_t tried_at[16];
    int ntried = 0;
    uint64_t last = 0;
    for (int step = 0; step < 1100; step++) {
        fails += unpackable_step(pool);
        struct msh_pool_stats s = stats(pool);
        if (s.plan_failed != last && ntried < 16) tried_at[ntried++] = (uint64_t)step;
        last = s.plan_failed;
    }
    struct msh_pool_stats s = stats(pool);
    printf("    1100 steps: %llu packings tried, at steps", (unsigned long long)s.plan_failed);
    for (int i = 0; i < ntried; i++) printf(" %llu", (unsigned long long)tried_at[i]);
    printf("\n");
    CHECK(fails == 0 && s.plans_built == 0);
    /* tried at the first repeat, then after 64, 128, 256 and 512 step lengths (~960 in all) */
    CHECKF(s.plan_failed == 5, "%llu packings tried in 1100 steps (5 with the back-off doubling)", (unsigned long long)s.plan_failed);
    for (int i = 2; i < ntried; i++)
        CHECKF(tried_at[i] - tried_at[i - 1] > tried_at[i - 1] - tried_at[i - 2], "try %d came %llu steps after the one before, try %d %llu",
               i, (unsigned long long)(tried_at[i] - tried_at[i - 1]), i - 1, (unsigned long long)(tried_at[i - 1] - tried_at[i - 2]));
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->live_maps == 0 && f->misuse == 0);
    free(f);
}

/* Found by review: with a small granularity a huge request overflowed the 32-bit page count and
 * "succeeded" with almost nothing mapped. It must be refused instead. */
TEST(huge_request_with_small_pages_is_refused_not_truncated)
{
    struct msh_device d;
    REQUIRE(msh_dev_sim_init(&d, 0, 4096) == 0);
    struct msh_pool *pool = NULL;
    REQUIRE(msh_pool_create(&d, NULL, &pool) == 0);
    uint64_t a = 0;
    int rc = msh_pool_alloc(pool, ((size_t)16 << 40) + 4096, 0, &a);
    CHECK(rc == ENOMEM);
    CHECK(msh_pool_alloc(pool, 1 << 20, 0, &a) == 0); /* the pool still works */
    CHECK(msh_pool_free(pool, a, MSH_STREAM_COMPLETED) == 0);
    msh_pool_destroy(pool);
    msh_dev_sim_fini(&d);
}

TEST(step_peaks_and_the_reserve_at_the_peak_computed_by_hand)
{
    /* The figures behind the reports' fragmentation.step_allocated_over_reserved and
     * reserved_minus_allocated_at_peak_bytes (pages of 2 MiB mapped as blocks touch them, no
     * limit, blocks placed from the start of the line, lowest fitting address first):
     *   step 1: A 4 MiB at 0 (pages 0-1), B 3 MiB at 4 MiB (pages 2-3): 8 MiB reserved, 7 live at
     *           most; B freed. Peaks 7 / 8. The reserve first reached 8 MiB with 7 live: 1 MiB.
     *   step 2: C 2 MiB in B's place (no new page), freed: peaks 6 / 8 (8 held from the start).
     *   step 3: D 10 MiB at 4 MiB, B's free run extended past the last page (pages 4-6 more):
     *           14 MiB reserved with 14 live: peaks 14 / 14; the reserve peak moves to 14 MiB with
     *           14 live: 0 MiB.
     *   step 4: D and A freed, the cache emptied: the peaks of the step are still 14 / 14 (held
     *           when it began); the next step, with nothing held, has none (0 / 0).
     * A step mark takes the peaks since the last one and restarts them at the current figures;
     * an epoch boundary (reset_peaks) restarts all of them. */
    struct fake *f = fake_new(0, 0);
    struct msh_pool *pool = mk_pool(&f->dev, 0, true, 0);
    REQUIRE(pool);
    uint64_t a, b, c, d;
    size_t live, resv;
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 1, &a) == 0);
    REQUIRE(msh_pool_alloc(pool, 3 * MiB, 1, &b) == 0);
    CHECK(b == a + 4 * MiB && stats(pool).mapped_bytes == 8 * MiB);
    CHECK(msh_pool_free(pool, b, 1) == 0);
    msh_pool_take_step_peaks(pool, &live, &resv);
    CHECKF(live == 7 * MiB && resv == 8 * MiB, "step 1: %zu / %zu", live, resv);
    struct msh_pool_stats s = stats(pool);
    CHECK(s.at_peak_mapped_bytes == 8 * MiB && s.at_peak_live_bytes == 7 * MiB);
    REQUIRE(msh_pool_alloc(pool, 2 * MiB, 1, &c) == 0);
    CHECK(c == b);
    CHECK(msh_pool_free(pool, c, 1) == 0);
    msh_pool_take_step_peaks(pool, &live, &resv);
    CHECKF(live == 6 * MiB && resv == 8 * MiB, "step 2: %zu / %zu", live, resv);
    REQUIRE(msh_pool_alloc(pool, 10 * MiB, 1, &d) == 0);
    CHECK(d == b && stats(pool).mapped_bytes == 14 * MiB);
    msh_pool_take_step_peaks(pool, &live, &resv);
    CHECKF(live == 14 * MiB && resv == 14 * MiB, "step 3: %zu / %zu", live, resv);
    s = stats(pool);
    CHECK(s.at_peak_mapped_bytes == 14 * MiB && s.at_peak_live_bytes == 14 * MiB);
    CHECK(msh_pool_free(pool, d, 1) == 0 && msh_pool_free(pool, a, 1) == 0);
    CHECK(msh_pool_empty_cache(pool) == 14 * MiB);
    msh_pool_take_step_peaks(pool, &live, &resv);
    CHECKF(live == 14 * MiB && resv == 14 * MiB, "step 4: %zu / %zu", live, resv);
    msh_pool_take_step_peaks(pool, &live, &resv);
    CHECKF(live == 0 && resv == 0, "an empty step: %zu / %zu", live, resv);
    /* an epoch boundary: the pair restarts at what is held and live now */
    REQUIRE(msh_pool_alloc(pool, 4 * MiB, 1, &a) == 0);
    msh_pool_reset_peaks(pool);
    s = stats(pool);
    CHECK(s.at_peak_mapped_bytes == 4 * MiB && s.at_peak_live_bytes == 4 * MiB);
    msh_pool_take_step_peaks(pool, &live, &resv);
    CHECK(live == 4 * MiB && resv == 4 * MiB);
    CHECK(msh_pool_free(pool, a, 1) == 0);
    msh_pool_destroy(pool);
    CHECK(f->live_handles == 0 && f->misuse == 0);
    free(f);
}

TEST_MAIN()
