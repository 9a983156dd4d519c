/*
 * test_models.c: the models of PyTorch's caching allocator (report/replay/models/model_torch.c,
 * model_expandable.c) on small synthetic streams, one rule of CUDACachingAllocator.cpp per test.
 */
#include <errno.h>

#include "harness.h"
#include "msh.h"
#include "policy.h"

#define KiB (1ull << 10)
#define MiB (1ull << 20)

static struct msh_policy *mk(enum msh_policy_kind k, uint64_t cap, const char *conf)
{
    struct msh_torch_conf c;
    char err[256];
    msh_torch_conf_default(&c);
    if (conf && msh_torch_conf_parse(conf, &c, err, sizeof err)) {
        fprintf(stderr, "    conf: %s\n", err);
        return NULL;
    }
    struct msh_policy *p = NULL;
    if (msh_policy_create(k, cap, &c, 0, &p)) return NULL;
    return p;
}

static struct msh_policy_stats st(struct msh_policy *p)
{
    struct msh_policy_stats s;
    msh_policy_get_stats(p, &s);
    return s;
}

static uint64_t A(struct msh_policy *p, uint64_t size, uint64_t stream)
{
    uint64_t a = 0;
    if (msh_policy_alloc(p, size, stream, &a)) return 0;
    return a;
}

TEST(rounding_to_512_and_power2_divisions)
{
    struct msh_torch_conf c;
    msh_torch_conf_default(&c);
    CHECK(msh_torch_round_size(&c, 0) == 512);
    CHECK(msh_torch_round_size(&c, 1) == 512);
    CHECK(msh_torch_round_size(&c, 512) == 512);
    CHECK(msh_torch_round_size(&c, 513) == 1024);
    CHECK(msh_torch_round_size(&c, 1200 * MiB + 1) == 1200 * MiB + 512);
    char err[256];
    CHECK(msh_torch_conf_parse("roundup_power2_divisions:4", &c, err, sizeof err) == 0);
    CHECK(msh_torch_round_size(&c, 1200 * MiB) == 1280 * MiB); /* 1024, 1280, 1536, 1792 */
    CHECK(msh_torch_round_size(&c, 1024 * MiB) == 1024 * MiB);  /* powers of two stay */
    CHECK(msh_torch_round_size(&c, 1200) == 1536);              /* below 512 * divisions: 512 rounding */
    msh_torch_conf_default(&c);
    CHECK(msh_torch_conf_parse("roundup_power2_divisions:[256:1,512:2,>:8]", &c, err, sizeof err) == 0);
    /* as CUDAAllocatorConfig parses it: '>' fills from the last key's interval on, inclusive */
    CHECK(c.divisions[0] == 1 && c.divisions[8] == 1 && c.divisions[9] == 8 && c.divisions[15] == 8);
    CHECK(msh_torch_round_size(&c, 600 * MiB) == 640 * MiB);   /* interval 512 MiB: 8 divisions */
    CHECK(msh_torch_conf_parse("roundup_power2_divisions:[256:1,512:2,1024:4]", &c, err, sizeof err) == 0);
    CHECK(msh_torch_round_size(&c, 600 * MiB) == 768 * MiB);   /* now 2 divisions */
    CHECK(msh_torch_round_size(&c, 300 * MiB) == 300 * MiB);   /* interval 256 MiB: 1 (off) */
}

TEST(segment_sizes_2_20_and_rounded)
{
    CHECK(msh_torch_allocation_size(512) == 2 * MiB);
    CHECK(msh_torch_allocation_size(1 * MiB) == 2 * MiB);
    CHECK(msh_torch_allocation_size(1 * MiB + 512) == 20 * MiB);
    CHECK(msh_torch_allocation_size(10 * MiB - 512) == 20 * MiB);
    CHECK(msh_torch_allocation_size(10 * MiB) == 10 * MiB);
    CHECK(msh_torch_allocation_size(11 * MiB) == 12 * MiB);
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    CHECK(A(p, 1000, 0));
    CHECK(st(p).reserved == 2 * MiB);
    CHECK(A(p, 2 * MiB, 0));
    CHECK(st(p).reserved == 22 * MiB);
    CHECK(A(p, 30 * MiB + 1, 0));
    CHECK(st(p).reserved == 54 * MiB && st(p).segs_created == 3);
    msh_policy_destroy(p);
}

TEST(small_pool_packs_2mib_segments)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    uint64_t a[5];
    for (int i = 0; i < 4; i++) a[i] = A(p, 512 * KiB, 0);
    CHECK(st(p).segs_created == 1);
    CHECK(a[1] == a[0] + 512 * KiB && a[3] == a[0] + 1536 * KiB); /* cut from the front, in order */
    a[4] = A(p, 512 * KiB, 0);
    CHECK(st(p).segs_created == 2);
    /* a small request never comes from the large pool */
    struct msh_policy *q = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(q);
    uint64_t big = A(q, 4 * MiB, 0);
    msh_policy_free(q, big, 0);
    CHECK(A(q, 4096, 0));
    CHECK(st(q).segs_created == 2);
    msh_policy_destroy(q);
    msh_policy_destroy(p);
}

TEST(best_fit_by_stream_size_address)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 30 * MiB, 0), b = A(p, 40 * MiB, 0), c = A(p, 30 * MiB, 0), d = A(p, 26 * MiB, 0);
    REQUIRE(a && b && c && d && a < c);
    msh_policy_free(p, c, 0);
    msh_policy_free(p, b, 0);
    msh_policy_free(p, a, 0);
    /* 25 MiB: the 26 MiB segment is live; smallest fits are the two 30 MiB ones: lower address */
    CHECK(A(p, 25 * MiB, 0) == a);
    CHECK(A(p, 28 * MiB, 0) == c);
    CHECK(A(p, 35 * MiB, 0) == b);
    CHECK(st(p).segs_created == 4);
    msh_policy_destroy(p);
}

TEST(split_rules_large_and_small)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    /* large: a remainder of 1 MiB or less stays with the block */
    uint64_t a = A(p, 19 * MiB + 512 * KiB, 0);
    CHECK(msh_torch_block_size(p, a) == 20 * MiB);
    /* large: a remainder above 1 MiB is split off and reused */
    uint64_t b = A(p, 5 * MiB, 0);
    CHECK(msh_torch_block_size(p, b) == 5 * MiB);
    uint64_t c = A(p, 12 * MiB, 0);
    CHECK(c == b + 5 * MiB && st(p).segs_created == 2);
    /* small: any remainder of 512 bytes or more is split off */
    uint64_t s1 = A(p, 1 * MiB, 0);
    uint64_t s = A(p, 1 * MiB - 1024 - 100, 0);
    CHECK(s == s1 + 1 * MiB && msh_torch_block_size(p, s) == 1 * MiB - 1024);
    CHECK(A(p, 1000, 0) == s + 1 * MiB - 1024);
    CHECK(st(p).segs_created == 3);
    msh_policy_destroy(p);
}

TEST(max_split_size_mb)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, "max_split_size_mb:64");
    REQUIRE(p);
    uint64_t a = A(p, 100 * MiB, 0);
    msh_policy_free(p, a, 0);
    /* below max_split_size: never from an oversize block */
    uint64_t b = A(p, 50 * MiB, 0);
    CHECK(b != a && st(p).segs_created == 2);
    /* oversize within 20 MiB of the cached size: reused whole, not split */
    uint64_t c = A(p, 90 * MiB, 0);
    CHECK(c == a && msh_torch_block_size(p, c) == 100 * MiB);
    msh_policy_free(p, c, 0);
    /* oversize, 20 MiB or more smaller: a new segment */
    uint64_t d = A(p, 70 * MiB, 0);
    CHECK(d != a && st(p).segs_created == 3);
    /* a segment for a small request is still split */
    msh_policy_free(p, b, 0);
    uint64_t e = A(p, 10 * MiB, 0);
    CHECK(e == b && msh_torch_block_size(p, e) == 10 * MiB);
    msh_policy_destroy(p);
    char err[128];
    struct msh_torch_conf cf;
    msh_torch_conf_default(&cf);
    CHECK(msh_torch_conf_parse("max_split_size_mb:5", &cf, err, sizeof err) == 0 && cf.max_split_size == 20 * MiB);
}

TEST(merging_only_inside_a_segment)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    /* two adjacent 20 MiB segments, as a driver may hand out */
    CHECK(msh_torch_seed_segment(p, 0x10000000, 20 * MiB, 0, false) == 0);
    CHECK(msh_torch_seed_segment(p, 0x10000000 + 20 * MiB, 20 * MiB, 0, false) == 0);
    uint64_t x = A(p, 20 * MiB, 0), y = A(p, 20 * MiB, 0);
    CHECK(x == 0x10000000 && y == 0x10000000 + 20 * MiB);
    msh_policy_free(p, x, 0);
    msh_policy_free(p, y, 0);
    uint64_t z = A(p, 30 * MiB, 0); /* 40 MiB free, but in two segments */
    CHECK(z && z != x && st(p).segs_created == 1);
    /* inside one segment, neighbours merge back */
    uint64_t a = A(p, 6 * MiB, 0), b = A(p, 6 * MiB, 0), c = A(p, 6 * MiB, 0);
    CHECK(b == a + 6 * MiB && c == b + 6 * MiB);
    msh_policy_free(p, a, 0);
    msh_policy_free(p, b, 0);
    CHECK(A(p, 12 * MiB, 0) == a);
    msh_policy_destroy(p);
}

TEST(per_stream_reuse)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 30 * MiB, 1);
    msh_policy_free(p, a, 1);
    uint64_t b = A(p, 30 * MiB, 2);
    CHECK(b != a && st(p).segs_created == 2);
    CHECK(A(p, 30 * MiB, 1) == a);
    msh_policy_destroy(p);
}

TEST(oom_path_frees_cached_unsplit_segments_and_retries)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 60 * MiB, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 30 * MiB, 0);
    msh_policy_free(p, a, 0);
    CHECK(A(p, 40 * MiB, 0) != 0); /* 30 + 40 > 60: the cached 30 MiB segment goes, then it fits */
    struct msh_policy_stats s = st(p);
    CHECK(s.segs_freed == 1 && s.ooms == 0 && s.reserved == 40 * MiB);
    /* a cached block inside a split segment cannot be freed: an OOM */
    uint64_t b = A(p, 5 * MiB, 0); /* from a new 20 MiB segment: 15 MiB stay cached in it */
    CHECK(b && st(p).reserved == 60 * MiB);
    uint64_t c = 0;
    CHECK(msh_policy_alloc(p, 16 * MiB, 0, &c) == ENOMEM);
    CHECK(st(p).ooms == 1 && st(p).segs_freed == 1);
    /* with max_split_size, release_available_cached_blocks frees one oversize block only */
    struct msh_policy *q = mk(MSH_POLICY_TORCH, 250 * MiB, "max_split_size_mb:64");
    REQUIRE(q);
    uint64_t x = A(q, 100 * MiB, 0), y = A(q, 100 * MiB, 0);
    msh_policy_free(q, x, 0);
    msh_policy_free(q, y, 0);
    CHECK(A(q, 70 * MiB, 0) != 0);
    CHECK(st(q).segs_freed == 1 && st(q).reserved == 170 * MiB);
    msh_policy_destroy(q);
    msh_policy_destroy(p);
}

TEST(empty_cache_frees_only_whole_free_segments)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 30 * MiB, 0), b = A(p, 3 * MiB, 0), c = A(p, 100, 0);
    msh_policy_free(p, a, 0);
    msh_policy_free(p, c, 0);
    msh_policy_empty_cache(p); /* 30 MiB and the 2 MiB small segment go; b's 20 MiB segment stays */
    CHECK(st(p).reserved == 20 * MiB && st(p).segs_freed == 2);
    msh_policy_free(p, b, 0);
    msh_policy_empty_cache(p);
    CHECK(st(p).reserved == 0);
    msh_policy_destroy(p);
}

TEST(garbage_collection_threshold)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 100 * MiB, "garbage_collection_threshold:0.5");
    REQUIRE(p);
    uint64_t a = A(p, 60 * MiB, 0);
    msh_policy_free(p, a, 0);
    CHECK(A(p, 30 * MiB, 1) != 0); /* no fit on stream 1: GC first (60 > 50 MiB), then cudaMalloc */
    CHECK(st(p).segs_freed == 1 && st(p).reserved == 30 * MiB);
    msh_policy_destroy(p);
}

TEST(expandable_segments_grow_in_place)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH_EXPANDABLE, 0, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 5 * MiB, 0);
    CHECK(st(p).reserved == 20 * MiB && st(p).map_ops == 1);
    uint64_t b = A(p, 30 * MiB, 0); /* 15 MiB free tail + one more 20 MiB page mapped */
    CHECK(b == a + 5 * MiB && st(p).reserved == 40 * MiB && st(p).map_ops == 2);
    uint64_t s = A(p, 1000, 0); /* small pool: its own segment, 2 MiB pages */
    CHECK(s && st(p).reserved == 42 * MiB);
    /* any remainder of 512 bytes or more is split, large pool included */
    uint64_t c = A(p, 3 * MiB + 512, 0);
    CHECK(c == b + 30 * MiB && msh_torch_block_size(p, c) == 3 * MiB + 512);
    /* one segment per stream */
    uint64_t d = A(p, 1 * MiB + 4096, 7);
    CHECK(d && (d < a || d > a + 64 * MiB) && st(p).reserved == 62 * MiB);
    msh_policy_destroy(p);
}

TEST(expandable_segments_unmap_free_pages_on_oom)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH_EXPANDABLE, 60 * MiB, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 40 * MiB, 1);
    msh_policy_free(p, a, 1);
    CHECK(st(p).reserved == 40 * MiB);
    uint64_t b = A(p, 40 * MiB, 2); /* 40 + 40 > 60: stream 1's free pages are unmapped first */
    struct msh_policy_stats s = st(p);
    CHECK(b && s.ooms == 0 && s.unmap_ops == 1 && s.reserved == 40 * MiB);
    /* partly used pages stay mapped */
    uint64_t c = A(p, 10 * MiB, 2); /* 20 MiB page, 10 MiB used */
    msh_policy_free(p, b, 2);
    msh_policy_empty_cache(p);
    CHECK(st(p).reserved == 20 * MiB);
    msh_policy_free(p, c, 2);
    msh_policy_empty_cache(p);
    CHECK(st(p).reserved == 0);
    msh_policy_destroy(p);
}

TEST(seeding_places_blocks_in_recorded_segments)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    uint64_t base = 0x7f0000000000ull;
    REQUIRE(msh_torch_seed_segment(p, base, 20 * MiB, 0, false) == 0);
    CHECK(msh_torch_seed_block(p, base + 4 * MiB, 6 * MiB, 6 * MiB, 0) == 0);
    CHECK(msh_torch_seed_block(p, base + 30 * MiB, 1 * MiB, 1 * MiB, 0) == ENOENT);
    CHECK(msh_torch_cached_bytes(p) == 14 * MiB);
    /* best fit: the 4 MiB hole before the seeded block; a 1 MiB remainder is not split off */
    uint64_t h = A(p, 3 * MiB, 0);
    CHECK(h == base && msh_torch_block_size(p, h) == 4 * MiB);
    CHECK(A(p, 5 * MiB, 0) == base + 10 * MiB);
    msh_policy_destroy(p);
    p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    REQUIRE(msh_torch_seed_segment(p, base, 20 * MiB, 0, false) == 0);
    REQUIRE(msh_torch_seed_block(p, base + 4 * MiB, 6 * MiB, 6 * MiB, 0) == 0);
    CHECK(A(p, 2 * MiB, 0) == base); /* the 4 MiB hole is the smallest fit; 2 MiB rest is split */
    CHECK(msh_policy_free(p, base + 4 * MiB, 0) == 0);
    CHECK(msh_policy_free(p, base, 0) == 0);
    CHECK(msh_torch_cached_bytes(p) == 20 * MiB);
    msh_policy_empty_cache(p); /* merged back into one unsplit segment */
    CHECK(st(p).reserved == 0);
    msh_policy_destroy(p);
}

TEST(segment_log_and_address_hints)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    static const struct msh_seg_hint h[] = {{0x100000000ull, 20 * MiB}, {0x200000000ull, 2 * MiB}};
    msh_torch_set_hints(p, h, 2);
    msh_torch_log_segments(p, true);
    msh_torch_set_clock(p, 7);
    CHECK(A(p, 3 * MiB, 0) == 0x100000000ull);
    CHECK(A(p, 64, 0) == 0x200000000ull);
    uint64_t c = A(p, 40 * MiB, 0); /* no hint left: a model address */
    CHECK(c >= (1ull << 56));
    size_t n = 0;
    const struct msh_segev *lg = msh_torch_segment_log(p, &n);
    CHECK(n == 3 && lg[0].op == MSH_SEG_ALLOC && lg[0].size == 20 * MiB && lg[0].at == 7 && lg[2].size == 40 * MiB);
    msh_policy_destroy(p);
}

TEST(conf_errors_are_reported)
{
    struct msh_torch_conf c;
    char err[256];
    msh_torch_conf_default(&c);
    CHECK(msh_torch_conf_parse("max_split_size_mb:abc", &c, err, sizeof err) == EINVAL && strstr(err, "max_split"));
    CHECK(msh_torch_conf_parse("garbage_collection_threshold:1.5", &c, err, sizeof err) == EINVAL);
    CHECK(msh_torch_conf_parse("roundup_power2_divisions:3", &c, err, sizeof err) == EINVAL);
    CHECK(msh_torch_conf_parse("expandable_segments:maybe", &c, err, sizeof err) == EINVAL);
    CHECK(msh_torch_conf_parse("no_such_knob:1", &c, err, sizeof err) == EINVAL && strstr(err, "no_such_knob"));
    CHECK(msh_torch_conf_parse("expandable_segments:True,pinned_use_cuda_host_register:True", &c, err, sizeof err) == 0 &&
          c.expandable);
    char buf[256];
    msh_torch_conf_default(&c);
    msh_torch_conf_parse("max_split_size_mb:128,garbage_collection_threshold:0.6", &c, err, sizeof err);
    msh_torch_conf_format(&c, buf, sizeof buf);
    CHECK(!strcmp(buf, "max_split_size_mb:128,garbage_collection_threshold:0.6"));
}

TEST(memshim_behind_the_same_interface)
{
    msh_log_level = MSH_LOG_ERROR; /* the pool's OOM warning is expected here */
    struct msh_policy *p = mk(MSH_POLICY_MEMSHIM, 64 * MiB, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 30 * MiB, 0), b = A(p, 30 * MiB, 0), c = 0;
    CHECK(a && b);
    CHECK(msh_policy_alloc(p, 30 * MiB, 0, &c) == ENOMEM && st(p).ooms == 1);
    CHECK(msh_policy_free(p, a, 0) == 0);
    CHECK(st(p).peak_reserved <= 64 * MiB && st(p).map_ops > 0);
    msh_policy_destroy(p);
}

/* ---- driver calls the models count (issue 10): what CUDACachingAllocator.cpp would call ---- */
#define C_(s, k) ((s).drv_calls[MSH_DRV_##k])
#define B_(s, k) ((s).drv_bytes[MSH_DRV_##k])
#define M_(s, k) ((s).drv_maps[MSH_DRV_##k])

TEST(native_counts_cudamalloc_and_cudafree_with_its_synchronize)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 30 * MiB, 0);
    struct msh_policy_stats s = st(p);
    CHECK(C_(s, MALLOC) == 1 && B_(s, MALLOC) == 30 * MiB);
    CHECK(C_(s, FREE) == 0 && C_(s, SYNCHRONIZE) == 0 && C_(s, CREATE) == 0 && C_(s, MAP) == 0);
    msh_policy_free(p, a, 0);
    CHECK(A(p, 30 * MiB, 0) == a && C_(st(p), MALLOC) == 1); /* a cache hit calls nothing */
    msh_policy_free(p, a, 0);
    msh_policy_empty_cache(p);
    s = st(p);
    CHECK(C_(s, FREE) == 1 && B_(s, FREE) == 30 * MiB && C_(s, SYNCHRONIZE) == 1);
    msh_policy_destroy(p);
}

TEST(native_oom_path_counts_the_failed_cudamalloc_and_the_flush)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 40 * MiB, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 30 * MiB, 0);
    msh_policy_free(p, a, 0);
    /* no cached block fits 32 MiB; cudaMalloc fails (30 + 32 > 40), every cached unsplit
     * segment is cudaFree'd (each with its synchronize), cudaMalloc again succeeds */
    CHECK(A(p, 32 * MiB, 0) != 0);
    struct msh_policy_stats s = st(p);
    CHECK(C_(s, MALLOC) == 3 && B_(s, MALLOC) == 62 * MiB);
    CHECK(C_(s, FREE) == 1 && C_(s, SYNCHRONIZE) == 1 && s.ooms == 0);
    /* a request that never fits: two failed cudaMalloc calls (first try and after the flush) */
    uint64_t b = 0;
    CHECK(msh_policy_alloc(p, 40 * MiB, 0, &b) == ENOMEM);
    s = st(p);
    CHECK(C_(s, MALLOC) == 5 && B_(s, MALLOC) == 62 * MiB && C_(s, FREE) == 1);
    msh_policy_destroy(p);
}

TEST(native_seeded_segments_count_as_cudamalloc)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH, 0, NULL);
    REQUIRE(p);
    CHECK(msh_torch_seed_segment(p, 1ull << 40, 20 * MiB, 0, false) == 0);
    CHECK(msh_torch_seed_segment(p, (1ull << 40) + 64 * MiB, 2 * MiB, 0, true) == 0);
    struct msh_policy_stats s = st(p);
    CHECK(C_(s, MALLOC) == 2 && B_(s, MALLOC) == 22 * MiB);
    msh_policy_destroy(p);
}

TEST(expandable_counts_per_page_create_map_and_one_set_access_per_range)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH_EXPANDABLE, 0, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 30 * MiB, 0); /* large pool: two 20 MiB pages in one map_block() */
    struct msh_policy_stats s = st(p);
    CHECK(a && C_(s, RESERVE) == 1 && C_(s, CREATE) == 2 && B_(s, CREATE) == 40 * MiB);
    CHECK(C_(s, MAP) == 2 && B_(s, MAP) == 40 * MiB);
    CHECK(C_(s, SET_ACCESS) == 1 && B_(s, SET_ACCESS) == 40 * MiB);
    /* the one grant covers both pages' mappings (the driver pays per mapping); every other call one */
    CHECK(M_(s, SET_ACCESS) == 2 && M_(s, CREATE) == 2 && M_(s, MAP) == 2 && M_(s, RESERVE) == 1);
    CHECK(C_(s, MALLOC) == 0 && C_(s, SYNCHRONIZE) == 0);
    /* growing by 20 MiB (10 MiB free tail + one new page): one more create, map and set_access */
    uint64_t b = A(p, 30 * MiB, 0);
    s = st(p);
    CHECK(b == a + 30 * MiB && C_(s, CREATE) == 3 && C_(s, MAP) == 3 && C_(s, SET_ACCESS) == 2);
    CHECK(M_(s, SET_ACCESS) == 3);
    CHECK(C_(s, RESERVE) == 1);
    /* small pool: its own segment (one more reserve), 2 MiB pages */
    uint64_t c = A(p, 1000, 0);
    s = st(p);
    CHECK(c && C_(s, RESERVE) == 2 && C_(s, CREATE) == 4 && B_(s, CREATE) == 62 * MiB && C_(s, SET_ACCESS) == 3);
    /* empty_cache: each free block's whole pages go with one synchronize per unmapped range, one
     * unmap and one release per page; a segment left with no page frees its address range */
    msh_policy_free(p, a, 0);
    msh_policy_free(p, b, 0);
    msh_policy_free(p, c, 0);
    msh_policy_empty_cache(p);
    s = st(p);
    CHECK(s.reserved == 0);
    CHECK(C_(s, SYNCHRONIZE) == 2 && C_(s, UNMAP) == 4 && B_(s, UNMAP) == 62 * MiB);
    CHECK(C_(s, RELEASE) == 4 && B_(s, RELEASE) == 62 * MiB && C_(s, UNRESERVE) == 2);
    CHECK(C_(s, FREE) == 0 && C_(s, MALLOC) == 0);
    msh_policy_destroy(p);
}

TEST(expandable_failed_map_counts_the_creates_it_tried_and_released)
{
    struct msh_policy *p = mk(MSH_POLICY_TORCH_EXPANDABLE, 50 * MiB, NULL);
    REQUIRE(p);
    uint64_t a = A(p, 10 * MiB, 0); /* one 20 MiB page */
    CHECK(a && C_(st(p), CREATE) == 1);
    uint64_t b = 0;
    /* 70 MiB more would need 4 pages; one fits (20 + 20 <= 50): cuMemCreate succeeds once, fails
     * on the second, the first is released. The OOM retry frees nothing (a's page is in use) and
     * tries again the same way. */
    CHECK(msh_policy_alloc(p, 80 * MiB, 0, &b) == ENOMEM);
    struct msh_policy_stats s = st(p);
    CHECK(C_(s, CREATE) == 1 + 2 * 2 && B_(s, CREATE) == 20 * MiB + 2 * 20 * MiB);
    CHECK(C_(s, RELEASE) == 2 && B_(s, RELEASE) == 40 * MiB && C_(s, MAP) == 1 && s.reserved == 20 * MiB);
    msh_policy_destroy(p);
}

TEST(memshim_policy_reports_the_pools_driver_calls)
{
    struct msh_policy *p = mk(MSH_POLICY_MEMSHIM, 0, NULL);
    REQUIRE(p);
    CHECK(A(p, 30 * MiB, 0));
    struct msh_policy_stats s = st(p);
    /* the pages the block alone covers share one handle (no limit: mapped on to the next 20 MiB
     * boundary at the open end of the line), and access is granted once for the block */
    CHECK(C_(s, CREATE) == C_(s, MAP) && C_(s, CREATE) >= 1 && C_(s, CREATE) <= 2);
    CHECK(C_(s, SET_ACCESS) == 1 && C_(s, RESERVE) >= 1);
    CHECK(B_(s, CREATE) >= 30 * MiB && B_(s, CREATE) <= 50 * MiB && B_(s, CREATE) % (2 * MiB) == 0);
    CHECK(B_(s, MAP) == B_(s, CREATE) && C_(s, MALLOC) == 0);
    /* the grant covers every handle the block's pages are mapped by */
    CHECK(M_(s, SET_ACCESS) == C_(s, CREATE) && M_(s, CREATE) == C_(s, CREATE));
    double t = msh_drvcost_seconds(msh_drvcost_default(), s.drv_calls, s.drv_bytes, s.drv_maps);
    const struct msh_drvcost *d = msh_drvcost_default();
    CHECK(t >= msh_drvcost_call(d, MSH_DRV_CREATE, 30, 1) + msh_drvcost_call(d, MSH_DRV_SET_ACCESS, 30, 1) && t < 1.0);
    msh_policy_destroy(p);
}

TEST_MAIN()
