/*
 * never_calls.c: two of the docs' "never" claims (issue 31 item 4, tests/promises/index.txt)
 * that only a program around memshim can see. The program defines the functions in question
 * itself and exports them (linked -rdynamic), so memshim's calls reach them first and are counted:
 *  - the pool's own memory (block slabs, hash table, page tables, the step log, event table)
 *    comes from mmap, never from malloc (docs/pool.md): thousands of blocks of every size class
 *    over fresh pages and streams, then all freed, make no malloc, calloc or realloc call from
 *    libmemshim.so's code (the driver double keeps its own books with malloc: not counted);
 *  - reports are not fsynced, so an epoch close never waits for the disk (docs/reliability.md):
 *    epoch closes that write reports make no fsync, fdatasync, syncfs or sync call.
 * Run under LD_PRELOAD=libmemshim.so with MEMSHIM_REPORT_DIR set.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>
#include <string.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

#include "harness.h"

#define EXPORT __attribute__((visibility("default")))
#define MiB ((size_t)1 << 20)

void *__libc_malloc(size_t);
void *__libc_calloc(size_t, size_t);
void *__libc_realloc(void *, size_t);
void __libc_free(void *);

static _Atomic long mallocs, syncs;
static _Atomic int counting;
static uintptr_t lib_lo, lib_hi; /* libmemshim.so's code: the driver double mallocs for itself */

static int find_lib(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size, (void)arg;
    if (!info->dlpi_name || !strstr(info->dlpi_name, "libmemshim.so")) return 0;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_LOAD && (info->dlpi_phdr[i].p_flags & PF_X)) {
            lib_lo = info->dlpi_addr + info->dlpi_phdr[i].p_vaddr;
            lib_hi = lib_lo + info->dlpi_phdr[i].p_memsz;
        }
    return 1;
}

static void note(void *from)
{
    if (atomic_load_explicit(&counting, memory_order_relaxed) && (uintptr_t)from >= lib_lo && (uintptr_t)from < lib_hi)
        atomic_fetch_add(&mallocs, 1);
}

EXPORT void *malloc(size_t n)
{
    note(__builtin_return_address(0));
    return __libc_malloc(n);
}
EXPORT void *calloc(size_t a, size_t b)
{
    note(__builtin_return_address(0));
    return __libc_calloc(a, b);
}
EXPORT void *realloc(void *p, size_t n)
{
    note(__builtin_return_address(0));
    return __libc_realloc(p, n);
}
EXPORT void free(void *p)
{
    __libc_free(p);
}

static int real_sync(const char *name, int fd)
{
    int (*f)(int) = (int (*)(int))dlsym(RTLD_NEXT, name);
    return f ? f(fd) : 0;
}
EXPORT int fsync(int fd)
{
    atomic_fetch_add(&syncs, 1);
    return real_sync("fsync", fd);
}
EXPORT int fdatasync(int fd)
{
    atomic_fetch_add(&syncs, 1);
    return real_sync("fdatasync", fd);
}
EXPORT int syncfs(int fd)
{
    atomic_fetch_add(&syncs, 1);
    return real_sync("syncfs", fd);
}
EXPORT void sync(void)
{
    atomic_fetch_add(&syncs, 1);
}

typedef void *(*ms_malloc_fn)(ssize_t, int, void *);
typedef void (*ms_free_fn)(void *, ssize_t, int, void *);

TEST(the_pool_grows_and_shrinks_without_the_host_allocator)
{
    ms_malloc_fn m = (ms_malloc_fn)dlsym(RTLD_DEFAULT, "memshim_malloc");
    ms_free_fn f = (ms_free_fn)dlsym(RTLD_DEFAULT, "memshim_free");
    REQUIRE(m && f);
    cudaStream_t s[3] = {0, 0, 0};
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cudaStreamCreate(&s[1]) == cudaSuccess && cudaStreamCreate(&s[2]) == cudaSuccess);
    void *warm = m(4096, 0, NULL); /* the pool and its first structures, and memshim's start-up */
    REQUIRE(warm);
    dl_iterate_phdr(find_lib, NULL);
    REQUIRE(lib_lo && lib_hi > lib_lo);
    enum { N = 6000 };
    static void *p[N];
    static size_t sz[N];
    uint32_t x = 7;
    atomic_store(&mallocs, 0);
    atomic_store(&counting, 1);
    for (int i = 0; i < N; i++) { /* small, medium, large: slabs, hash and page tables grow */
        x = x * 1103515245u + 12345u;
        sz[i] = i % 50 == 0 ? (size_t)(1 + x % 24) * MiB : i % 7 == 0 ? (size_t)(x % (2 * MiB)) + 1 : 512 + x % 65536;
        p[i] = m((ssize_t)sz[i], 0, s[i % 3]);
        if (!p[i]) break;
    }
    for (int i = N - 1; i >= 0; i--)
        if (p[i]) f(p[i], (ssize_t)sz[i], 0, s[(i + 1) % 3]); /* freed on another stream: events */
    for (int i = 0; i < N / 2; i++) p[i] = m((ssize_t)sz[i], 0, s[i % 3]); /* reuse across streams */
    for (int i = 0; i < N / 2; i++)
        if (p[i]) f(p[i], (ssize_t)sz[i], 0, s[i % 3]);
    atomic_store(&counting, 0);
    long n = atomic_load(&mallocs);
    printf("    %d allocations and frees over 3 streams: %ld calls of malloc, calloc or realloc\n", 3 * N, n);
    CHECK(p[N - 1] != NULL || p[0] != NULL);
    CHECKF(n == 0, "%ld host allocator calls while the pool grew and shrank", n);
    f(warm, 4096, 0, NULL);
    cudaStreamDestroy(s[1]);
    cudaStreamDestroy(s[2]);
}

TEST(an_epoch_close_never_waits_for_the_disk)
{
    void (*epoch)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "memshim_epoch");
    ms_malloc_fn m = (ms_malloc_fn)dlsym(RTLD_DEFAULT, "memshim_malloc");
    ms_free_fn f = (ms_free_fn)dlsym(RTLD_DEFAULT, "memshim_free");
    REQUIRE(epoch && m && f && getenv("MEMSHIM_REPORT_DIR"));
    atomic_store(&syncs, 0);
    for (int e = 0; e < 3; e++) {
        void *a = m(3 * MiB, 0, NULL);
        REQUIRE(a);
        f(a, 3 * MiB, 0, NULL);
        epoch(); /* writes this epoch's report */
    }
    long n = atomic_load(&syncs);
    printf("    3 epoch closes with reports: %ld fsync, fdatasync, syncfs or sync calls\n", n);
    CHECKF(n == 0, "%ld calls that wait for the disk", n);
}

TEST_MAIN()
