/*
 * glue_routing.cpp: which pool an allocation goes to while CUDA-graph pools are begun, held
 * against PyTorch's rule (issue 18, item 2; run by tests/differential/test_differential.py).
 *
 * PyTorch's rule (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator::get_pool): the
 * device's captures_underway, in the order beginAllocateToPool added them, are asked in turn; the
 * first whose filter returns true for the allocation's stream takes it; none: the main pool.
 * endAllocateToPool erases that pool's entry; releasePool only counts uses down (it never ends a
 * capture). Each device has its own captures_underway (one DeviceCachingAllocator per device).
 *
 * This program loads the real glue (libmemshim_torch.so) and stands in for libmemshim.so's C
 * entry points itself: it defines memshim_torch_alloc, memshim_torch_alloc_in_pool, ... and is
 * linked with -rdynamic, so the glue's dlsym(RTLD_DEFAULT) finds these and each allocation says
 * where the glue sent it. Prints "ok"/"FAIL" lines and "N passed, N failed". Test code only.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/types.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>

using MempoolId = std::pair<unsigned long long, unsigned long long>; /* c10::cuda::MempoolId_t */
using Filter = std::function<bool(cudaStream_t)>;

/* ---- the recording stand-in for libmemshim.so ------------------------------------------------ */
static char arena[1 << 16];
static size_t arena_used;
static std::string last; /* "main" or "pool:<id0>,<id1>" */
static int uses_left[16];

static void *give(size_t size)
{
    void *p = arena + (arena_used % (sizeof arena - 4096));
    arena_used += 64 + (size & 1023);
    return p;
}

extern "C" __attribute__((visibility("default"))) void *memshim_torch_alloc(ssize_t size, int, void *)
{
    last = "main";
    return size > 0 ? give((size_t)size) : nullptr; /* size 0: NULL, as libmemshim.so answers it */
}
extern "C" __attribute__((visibility("default"))) void *memshim_torch_alloc_in_pool(ssize_t size, int, void *,
                                                                                    unsigned long long id0,
                                                                                    unsigned long long id1)
{
    last = "pool:" + std::to_string(id0) + "," + std::to_string(id1);
    return size > 0 ? give((size_t)size) : nullptr;
}
extern "C" __attribute__((visibility("default"))) void memshim_torch_free(void *, ssize_t, int, void *) {}
extern "C" __attribute__((visibility("default"))) void memshim_torch_begin_allocate_to_pool(int, unsigned long long id0,
                                                                                           unsigned long long,
                                                                                           void *)
{
    uses_left[id0 % 16]++;
}
extern "C" __attribute__((visibility("default"))) void memshim_torch_end_allocate_to_pool(int, unsigned long long,
                                                                                         unsigned long long)
{
}
extern "C" __attribute__((visibility("default"))) void memshim_torch_release_pool(int, unsigned long long id0,
                                                                                 unsigned long long)
{
    uses_left[id0 % 16]--;
}
extern "C" __attribute__((visibility("default"))) void memshim_torch_retain_pool(int, unsigned long long id0,
                                                                                unsigned long long)
{
    uses_left[id0 % 16]++;
}
extern "C" __attribute__((visibility("default"))) int memshim_torch_pool_uses(int, unsigned long long id0,
                                                                             unsigned long long)
{
    return uses_left[id0 % 16];
}
extern "C" __attribute__((visibility("default"))) int memshim_torch_oom_message(int, size_t, char *buf, size_t len)
{
    return snprintf(buf, len, "CUDA out of memory. (stand-in)");
}

/* ---- the glue's entry points ------------------------------------------------------------------ */
static void *(*g_malloc)(ssize_t, int, cudaStream_t);
static void (*g_begin)(int, MempoolId, Filter);
static void (*g_end)(int, MempoolId);
static void (*g_release)(int, MempoolId);

static int passed, failed;
static void check(const char *name, bool ok, const std::string &detail = "")
{
    if (ok) {
        passed++;
        printf("ok   %s\n", name);
    } else {
        failed++;
        printf("FAIL %s: %s\n", name, detail.c_str());
    }
}

static std::string route(int device, cudaStream_t s, ssize_t size = 4096)
{
    last = "?";
    try {
        void *p = g_malloc(size, device, s);
        if (!p && size) return "NULL";
    } catch (const std::exception &e) {
        return std::string("threw: ") + e.what();
    }
    return last;
}

static cudaStream_t S(int i) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(0x1000 * i)); }

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: glue_routing PATH/libmemshim_torch.so\n");
        return 2;
    }
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        printf("FAIL loading the glue: %s\n0 passed, 1 failed, 0 skipped\n", dlerror());
        return 1;
    }
    g_malloc = reinterpret_cast<decltype(g_malloc)>(dlsym(h, "memshim_glue_malloc"));
    g_begin = reinterpret_cast<decltype(g_begin)>(dlsym(h, "memshim_glue_begin_allocate_to_pool"));
    g_end = reinterpret_cast<decltype(g_end)>(dlsym(h, "memshim_glue_end_allocate_to_pool"));
    g_release = reinterpret_cast<decltype(g_release)>(dlsym(h, "memshim_glue_release_pool"));
    if (!g_malloc || !g_begin || !g_end || !g_release) {
        printf("FAIL the glue lacks an entry point\n0 passed, 1 failed, 0 skipped\n");
        return 1;
    }
    const MempoolId A{1, 0}, B{2, 0}, C{3, 0};
    auto only = [](cudaStream_t want) { return Filter([want](cudaStream_t s) { return s == want; }); };
    auto any = Filter([](cudaStream_t) { return true; });

    check("no pool begun: the main pool", route(0, S(1)) == "main", route(0, S(1)));
    g_begin(0, A, only(S(1))); /* graph 1 captured into A, then graph 2 shares A (uses 2) */
    g_end(0, A);
    check("a pool whose capture ended takes nothing", route(0, S(1)) == "main", route(0, S(1)));
    g_begin(0, A, only(S(1)));
    g_begin(0, B, only(S(2)));
    check("each capture's filter takes its own stream", route(0, S(1)) == "pool:1,0" && route(0, S(2)) == "pool:2,0",
          route(0, S(1)) + " / " + route(0, S(2)));
    check("a stream no filter takes goes to the main pool", route(0, S(3)) == "main", route(0, S(3)));
    check("pools begun on device 0 do not take device 1's allocations", route(1, S(1)) == "main", route(1, S(1)));
    g_begin(0, C, any);
    /* get_pool: the first of captures_underway (begin order) whose filter says yes */
    check("filters that both claim a stream: the earlier begun pool takes it (get_pool's order)",
          route(0, S(2)) == "pool:2,0", route(0, S(2)));
    check("a stream only the later filter claims goes to it", route(0, S(7)) == "pool:3,0", route(0, S(7)));
    g_end(0, B);
    check("after endAllocateToPool of one pool, the next filter in order takes its stream",
          route(0, S(2)) == "pool:3,0", route(0, S(2)));
    g_release(0, A); /* graph 1 reset: a use counted down is no end (releasePool leaves captures_underway) */
    check("releasePool does not end a capture still underway", route(0, S(1)) == "pool:1,0", route(0, S(1)));
    g_end(0, A);
    g_end(0, C);
    check("every capture ended: the main pool again", route(0, S(1)) == "main" && route(0, S(7)) == "main",
          route(0, S(1)) + " / " + route(0, S(7)));
    /* memshim's rule beyond get_pool (the glue's drop_active): a capture abandoned without
     * endAllocateToPool (an older PyTorch's failed capture) leaves its entry in captures_underway,
     * and PyTorch would route its filter's streams into that pool for the rest of the process. Once
     * releasePool has counted the pool's last use down, memshim drops the stale entry: the
     * stream's allocations go back to the main pool, and the filter is never called again. */
    const MempoolId D{4, 0};
    int stale_calls = 0;
    g_begin(0, D, Filter([&stale_calls](cudaStream_t s) { stale_calls++; return s == S(4); }));
    check("a capture begun and never ended takes its stream", route(0, S(4)) == "pool:4,0", route(0, S(4)));
    g_release(0, D); /* its only use released */
    int calls_before = stale_calls;
    std::string after = route(0, S(4));
    check("releasePool of its last use drops the abandoned capture: the main pool, its filter never called again",
          after == "main" && stale_calls == calls_before, after + ", filter called " +
          std::to_string(stale_calls - calls_before) + " more times");
    /* size 0: PyTorch's own allocator hands out NULL without an allocation; the glue must not turn
     * memshim's NULL for it into an OutOfMemoryError, in the main pool or in a capture pool */
    std::string z = route(0, S(1), 0);
    g_begin(0, A, any);
    std::string zp = route(0, S(1), 0);
    g_end(0, A);
    check("size 0 is NULL, not an OutOfMemoryError (main pool, capture pool)", z == "main" && zp == "pool:1,0",
          z + " / " + zp);
    printf("%d passed, %d failed, 0 skipped\n", passed, failed);
    return failed ? 1 : 0;
}
