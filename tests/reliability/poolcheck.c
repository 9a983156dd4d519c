/*
 * poolcheck.c: libreli-poolcheck.so, preloaded by the fault-injection suite IN FRONT OF
 * libmemshim.so (LD_PRELOAD=libreli-poolcheck.so:libmemshim.so:...). It wraps the allocator entry
 * points a workload calls (cudaMalloc, cudaFree and memshim's pluggable-allocator API, which
 * programs look up with dlsym(RTLD_DEFAULT) and so find here first), calls memshim's own function
 * through RTLD_NEXT, and after every call runs memshim_debug_check() (shim/selfcheck.c: the pool's
 * invariants, msh_pool_check). A fault injected into any driver call happens inside one of these
 * calls, so the invariants are checked right after every injected failure, in the library as
 * shipped. The first violation is printed as "reli-poolcheck: POOL INVARIANT BROKEN after <call>:
 * <why>"; at exit one line "reli-poolcheck: N checks, M violations". It must never change what
 * the program or memshim does: it only adds checks between calls.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static struct {
    cudaError_t (*cuda_malloc)(void **, size_t);
    cudaError_t (*cuda_free)(void *);
    void *(*ms_malloc)(ssize_t, int, void *);
    void (*ms_free)(void *, ssize_t, int, void *);
    void (*ms_record)(void *, void *);
    void (*ms_empty)(void);
    void (*ms_epoch)(void);
    void (*ms_step)(void);
    int (*check)(char *, size_t);
} R;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static atomic_long nchecks, nbroken;

static void say(const char *s)
{
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(2, s, n);
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

static void resolve(void)
{
    *(void **)&R.cuda_malloc = dlsym(RTLD_NEXT, "cudaMalloc");
    *(void **)&R.cuda_free = dlsym(RTLD_NEXT, "cudaFree");
    *(void **)&R.ms_malloc = dlsym(RTLD_NEXT, "memshim_malloc");
    *(void **)&R.ms_free = dlsym(RTLD_NEXT, "memshim_free");
    *(void **)&R.ms_record = dlsym(RTLD_NEXT, "memshim_record_stream");
    *(void **)&R.ms_empty = dlsym(RTLD_NEXT, "memshim_empty_cache");
    *(void **)&R.ms_epoch = dlsym(RTLD_NEXT, "memshim_epoch");
    *(void **)&R.ms_step = dlsym(RTLD_NEXT, "memshim_step");
    *(void **)&R.check = dlsym(RTLD_NEXT, "memshim_debug_check");
    if (!R.check) say("reli-poolcheck: memshim_debug_check not found (is libmemshim.so preloaded after this library?)\n");
}

static void check_after(const char *call)
{
    if (!R.check) return;
    char why[512];
    atomic_fetch_add(&nchecks, 1);
    if (R.check(why, sizeof why) == 0) return;
    if (atomic_fetch_add(&nbroken, 1) == 0) {
        char line[700];
        snprintf(line, sizeof line, "reli-poolcheck: POOL INVARIANT BROKEN after %s: %s\n", call, why);
        say(line);
    }
}

#define WRAP_VOID(fn, field, params, args)                                                   \
    void fn params                                                                           \
    {                                                                                        \
        pthread_once(&once, resolve);                                                        \
        if (R.field) R.field args;                                                           \
        check_after(#fn);                                                                    \
    }

cudaError_t cudaMalloc(void **p, size_t n)
{
    pthread_once(&once, resolve);
    cudaError_t e = R.cuda_malloc ? R.cuda_malloc(p, n) : cudaErrorInitializationError;
    check_after("cudaMalloc");
    return e;
}

cudaError_t cudaFree(void *p)
{
    pthread_once(&once, resolve);
    cudaError_t e = R.cuda_free ? R.cuda_free(p) : cudaErrorInitializationError;
    check_after("cudaFree");
    return e;
}

void *memshim_malloc(ssize_t n, int dev, void *stream)
{
    pthread_once(&once, resolve);
    void *p = R.ms_malloc ? R.ms_malloc(n, dev, stream) : NULL;
    check_after("memshim_malloc");
    return p;
}

WRAP_VOID(memshim_free, ms_free, (void *p, ssize_t n, int dev, void *stream), (p, n, dev, stream))
WRAP_VOID(memshim_record_stream, ms_record, (void *p, void *stream), (p, stream))
WRAP_VOID(memshim_empty_cache, ms_empty, (void), ())
WRAP_VOID(memshim_epoch, ms_epoch, (void), ())
WRAP_VOID(memshim_step, ms_step, (void), ())

/* After memshim's atexit summary: the final state is checked too, then the count. */
__attribute__((destructor)) static void poolcheck_at_exit(void)
{
    pthread_once(&once, resolve);
    check_after("exit");
    char line[160];
    snprintf(line, sizeof line, "reli-poolcheck: %ld checks, %ld violations\n", atomic_load(&nchecks),
             atomic_load(&nbroken));
    say(line);
}
