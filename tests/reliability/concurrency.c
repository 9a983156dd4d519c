/*
 * concurrency.c: reli-concurrency, end-to-end concurrency checks of libmemshim.so. Run by
 * tests/reliability/concurrency.py under LD_PRELOAD=libmemshim.so on the CUDA doubles, one test
 * per process (argv[1]), each with the environment it needs; the runner then checks what the
 * process left behind (reports, trace). What tests/unit/test_stress.c already does on the pool
 * alone is repeated here only through the public entry points, with the hooks, the core and the
 * runtime in the path.
 *
 *   streams_8_threads   8 threads, each with two non-blocking streams plus one shared stream,
 *                       memshim_malloc/free and cudaMalloc/cudaFree for RELI_SECONDS (default 2)
 *                       with the GPU thread of the double running (CUDBL_ASYNC=1). Every block is
 *                       written by an emulated kernel on its stream, checked there, sometimes
 *                       handed to another stream (event + memshim_record_stream), and on free a
 *                       LATE check is queued on its stream(s) before memshim_free returns it: a
 *                       block reused by another stream before that work ran is caught.
 *   fork_while_allocating 4 threads allocate and free through memshim_malloc while the main
 *                       thread forks 12 children. A child must find memshim passed through
 *                       (memshim_malloc NULL, memshim_get_stats ENODEV), never block, and exit()
 *                       through memshim's atexit handler without writing a summary or a line of
 *                       the parent's trace. The parent goes on and its data stays intact.
 *   signal_storm        SIGALRM (setitimer, no SA_RESTART) and SIGUSR1 (kill from a thread,
 *                       SA_RESTART) arrive thousands of times while 4 threads allocate and free
 *                       through both APIs with reports, a trace and a log file on: no error
 *                       beyond OOM, no corruption.
 *   epoch_signal_storm  MEMSHIM_EPOCH=signal: SIGUSR2 sent hundreds of times while 4 threads
 *                       allocate; each closes an epoch and writes a report (checked by the
 *                       runner: every report complete JSON, no temp file left).
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#define MiB ((size_t)1 << 20)

struct ms_stats { size_t v[10]; };
static void *(*ms_malloc)(ssize_t, int, void *);
static void (*ms_free)(void *, ssize_t, int, void *);
static void (*ms_record)(void *, void *);
static void (*ms_epoch)(void);
static int (*ms_stats)(int, struct ms_stats *);

static int resolve(void)
{
    *(void **)&ms_malloc = dlsym(RTLD_DEFAULT, "memshim_malloc");
    *(void **)&ms_free = dlsym(RTLD_DEFAULT, "memshim_free");
    *(void **)&ms_record = dlsym(RTLD_DEFAULT, "memshim_record_stream");
    *(void **)&ms_epoch = dlsym(RTLD_DEFAULT, "memshim_epoch");
    *(void **)&ms_stats = dlsym(RTLD_DEFAULT, "memshim_get_stats");
    return ms_malloc && ms_free && ms_record && ms_epoch && ms_stats;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static double run_seconds(void)
{
    const char *v = getenv("RELI_SECONDS");
    double s = v ? atof(v) : 2.0;
    return s > 0 && s < 600 ? s : 2.0;
}

static uint64_t rng_next(uint64_t *r)
{
    uint64_t x = *r;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *r = x;
}

/* ---- patterns: one 8-byte word every 4 KiB and the last byte -------------------------------- */

static void pattern_put(unsigned char *p, size_t n, uint64_t tag)
{
    for (size_t i = 0; i + 8 < n; i += 4096) { /* never the last byte */
        uint64_t w = tag ^ (i * 0x9E3779B97F4A7C15ull);
        memcpy(p + i, &w, 8);
    }
    p[n - 1] = (unsigned char)(tag >> 3);
}

static int pattern_ok(const unsigned char *p, size_t n, uint64_t tag)
{
    for (size_t i = 0; i + 8 < n; i += 4096) { /* never the last byte */
        uint64_t w;
        memcpy(&w, p + i, 8);
        if (w != (tag ^ (i * 0x9E3779B97F4A7C15ull))) return 0;
    }
    return p[n - 1] == (unsigned char)(tag >> 3);
}

/* ---- emulated kernels (host functions queued on a stream; they never call CUDA) ------------- */

static atomic_long g_corrupt, g_kernels;

struct kern {
    unsigned char *p;
    size_t n;
    uint64_t tag;
    int write;
};

static void CUDART_CB k_run(void *arg)
{
    struct kern *k = arg;
    if (k->write) pattern_put(k->p, k->n, k->tag);
    else if (!pattern_ok(k->p, k->n, k->tag)) atomic_fetch_add(&g_corrupt, 1);
    atomic_fetch_add(&g_kernels, 1);
    free(k);
}

static int launch(cudaStream_t s, void *p, size_t n, uint64_t tag, int write)
{
    struct kern *k = malloc(sizeof *k);
    if (!k) return 1;
    *k = (struct kern){p, n, tag, write};
    if (cudaLaunchHostFunc(s, k_run, k) != cudaSuccess) {
        free(k);
        return 1;
    }
    return 0;
}

/* ---- streams_8_threads ---------------------------------------------------------------------- */

enum { THREADS = 8, SLOTS = 12 };
static cudaStream_t g_shared;
static atomic_long g_errors, g_allocs, g_ooms, g_handoffs;

struct held {
    unsigned char *p;
    size_t n;
    uint64_t tag;
    cudaStream_t s, rec;
    int pluggable;
};

static size_t pick_size(uint64_t x)
{
    unsigned b = (unsigned)(x % 100);
    x >>= 8;
    if (b < 70) return 1 + x % (96 * 1024);
    if (b < 95) return 96 * 1024 + x % (3 * MiB);
    return 3 * MiB + x % (13 * MiB);
}

static void release(struct held *h)
{
    if (h->pluggable) {
        /* the LATE check: queued before the free, it runs after memshim_free returned */
        if (launch(h->s, h->p, h->n, h->tag, 0)) atomic_fetch_add(&g_errors, 1);
        if (h->rec && launch(h->rec, h->p, h->n, h->tag, 0)) atomic_fetch_add(&g_errors, 1);
        ms_free(h->p, (ssize_t)h->n, 0, h->s);
    } else {
        /* cudaFree synchronizes the device: check on the host first */
        if (!pattern_ok(h->p, h->n, h->tag)) atomic_fetch_add(&g_corrupt, 1);
        if (cudaFree(h->p) != cudaSuccess) atomic_fetch_add(&g_errors, 1);
    }
    memset(h, 0, sizeof *h);
}

static void *streams_worker(void *arg)
{
    int id = (int)(uintptr_t)arg;
    cudaStream_t st[2];
    for (int i = 0; i < 2; i++)
        if (cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking) != cudaSuccess) {
            atomic_fetch_add(&g_errors, 1);
            return NULL;
        }
    struct held h[SLOTS];
    memset(h, 0, sizeof h);
    uint64_t r = 0x5EED0000ull + (uint64_t)id * 104729, seq = 0;
    double end = now_s() + run_seconds();
    while (now_s() < end) {
        uint64_t x = rng_next(&r);
        struct held *b = &h[x % SLOTS];
        x >>= 8;
        if (!b->p) {
            size_t n = pick_size(x);
            x >>= 30;
            b->pluggable = x % 5 != 0;
            b->tag = ((uint64_t)(id + 1) << 56) ^ (++seq << 16) ^ (x & 0xffff);
            b->n = n;
            void *p = NULL;
            if (b->pluggable) {
                b->s = (x >> 3) % 5 == 0 ? g_shared : st[(x >> 6) & 1];
                p = ms_malloc((ssize_t)n, 0, b->s);
                if (!p) atomic_fetch_add(&g_ooms, 1);
                else if (launch(b->s, p, n, b->tag, 1)) atomic_fetch_add(&g_errors, 1);
            } else {
                cudaError_t e = cudaMalloc(&p, n);
                if (e == cudaErrorMemoryAllocation) atomic_fetch_add(&g_ooms, 1);
                else if (e != cudaSuccess) atomic_fetch_add(&g_errors, 1);
                if (e != cudaSuccess) p = NULL;
                else pattern_put(p, n, b->tag);
            }
            if (!p) {
                memset(b, 0, sizeof *b);
                for (int i = 0; i < SLOTS; i++) /* give memory back so the run keeps moving */
                    if (h[i].p) { release(&h[i]); break; }
                continue;
            }
            b->p = p;
            atomic_fetch_add(&g_allocs, 1);
            continue;
        }
        unsigned what = (unsigned)(x % 10);
        if (what < 2 && b->pluggable && !b->rec) {
            /* hand over to another stream: it waits for the writer, checks, and is recorded */
            cudaStream_t o = b->s == st[0] ? st[1] : st[0];
            cudaEvent_t ev;
            if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess) {
                if (cudaEventRecord(ev, b->s) != cudaSuccess || cudaStreamWaitEvent(o, ev, 0) != cudaSuccess)
                    atomic_fetch_add(&g_errors, 1);
                cudaEventDestroy(ev);
                if (launch(o, b->p, b->n, b->tag, 0)) atomic_fetch_add(&g_errors, 1);
                ms_record(b->p, o);
                b->rec = o;
                atomic_fetch_add(&g_handoffs, 1);
            }
        } else if (what < 3 && b->pluggable) {
            if (launch(b->s, b->p, b->n, b->tag, 0)) atomic_fetch_add(&g_errors, 1);
        } else {
            release(b);
        }
    }
    for (int i = 0; i < SLOTS; i++)
        if (h[i].p) release(&h[i]);
    for (int i = 0; i < 2; i++) {
        cudaStreamSynchronize(st[i]);
        cudaStreamDestroy(st[i]);
    }
    return NULL;
}

TEST(streams_8_threads)
{
    REQUIRE(resolve());
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&g_shared, cudaStreamNonBlocking) == cudaSuccess);
    pthread_t th[THREADS];
    double t0 = now_s();
    for (int i = 0; i < THREADS; i++)
        REQUIRE(pthread_create(&th[i], NULL, streams_worker, (void *)(uintptr_t)i) == 0);
    for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
    cudaDeviceSynchronize(); /* every late check has run */
    cudaStreamDestroy(g_shared);
    struct ms_stats s;
    int have = ms_stats(0, &s) == 0;
    printf("    %d threads x 2 streams + 1 shared stream for %.1f s: %ld allocations, %ld stream "
           "hand-offs, %ld kernels (writes and checks), %ld OOM answers, %ld errors, %ld corrupted; "
           "pool: %zu map ops, %zu unmap ops\n",
           THREADS, now_s() - t0, atomic_load(&g_allocs), atomic_load(&g_handoffs),
           atomic_load(&g_kernels), atomic_load(&g_ooms), atomic_load(&g_errors),
           atomic_load(&g_corrupt), have ? s.v[4] : 0, have ? s.v[5] : 0);
    CHECK(have);
    CHECK(atomic_load(&g_allocs) > 1000);
    CHECK(atomic_load(&g_handoffs) > 10);
    CHECK(atomic_load(&g_errors) == 0);
    CHECK(atomic_load(&g_corrupt) == 0);
}

/* ---- fork_while_allocating ------------------------------------------------------------------ */

static atomic_int g_stop;
static atomic_long g_ops, g_fork_allocs;
static const size_t fork_sizes[] = {4096, 100000, 700 * 1024, 3 * MiB, 5 * MiB + 17};

static void *fork_worker(void *arg)
{
    int id = (int)(uintptr_t)arg;
    uint64_t r = 77 + (uint64_t)id;
    void *live[6] = {0};
    size_t n[6] = {0};
    uint64_t tag[6] = {0};
    while (!atomic_load(&g_stop)) {
        uint64_t x = rng_next(&r);
        int k = (int)(x % 6);
        if (live[k]) {
            if (!pattern_ok(live[k], n[k], tag[k])) atomic_fetch_add(&g_corrupt, 1);
            ms_free(live[k], (ssize_t)n[k], 0, NULL);
            live[k] = NULL;
        } else {
            n[k] = fork_sizes[(x >> 8) % 5];
            tag[k] = x;
            live[k] = ms_malloc((ssize_t)n[k], 0, NULL);
            if (!live[k]) atomic_fetch_add(&g_errors, 1);
            else pattern_put(live[k], n[k], tag[k]), atomic_fetch_add(&g_fork_allocs, 1);
        }
        atomic_fetch_add(&g_ops, 1);
    }
    for (int k = 0; k < 6; k++)
        if (live[k]) ms_free(live[k], (ssize_t)n[k], 0, NULL);
    return NULL;
}

/* The child: memshim must be a pass-through that never blocks; exit() runs memshim's atexit
 * handler (which must write nothing of the parent's). */
static void fork_child(void)
{
    alarm(10); /* a deadlock becomes SIGALRM, which the parent sees */
    int bad = 0;
    void *p = ms_malloc(65536, 0, NULL);
    if (p) bad |= 1; /* the parent's pool is not the child's */
    struct ms_stats s;
    if (ms_stats(0, &s) != ENODEV) bad |= 2;
    ms_epoch(); /* no report from a child */
    exit(bad ? 10 + bad : 0);
}

TEST(fork_while_allocating)
{
    REQUIRE(resolve());
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    unsigned char *keep = ms_malloc(3 * MiB, 0, NULL);
    REQUIRE(keep);
    pattern_put(keep, 3 * MiB, 0xFEEDull);
    pthread_t th[4];
    for (int i = 0; i < 4; i++) REQUIRE(pthread_create(&th[i], NULL, fork_worker, (void *)(uintptr_t)i) == 0);
    int ok_children = 0, n_children = 12;
    for (int i = 0; i < n_children; i++) {
        while (atomic_load(&g_ops) < (long)(i + 1) * 200) usleep(100);
        pid_t pid = fork();
        if (pid == 0) fork_child();
        REQUIRE(pid > 0);
        int status = 0;
        if (waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0) {
            ok_children++;
        } else {
            fprintf(stderr, "    child %d: %s (status 0x%x)\n", i,
                    WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM ? "hung" : "failed", status);
        }
    }
    atomic_store(&g_stop, 1);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    long ops = atomic_load(&g_ops);
    printf("    %d children forked while 4 threads made %ld memshim_malloc/free calls; %d exited "
           "cleanly\n", n_children, ops, ok_children);
    CHECK(ok_children == n_children);
    CHECK(atomic_load(&g_errors) == 0);
    CHECK(atomic_load(&g_corrupt) == 0);
    CHECK(pattern_ok(keep, 3 * MiB, 0xFEEDull));
    void *p = ms_malloc(12345, 0, NULL); /* the parent still works */
    CHECK(p != NULL);
    if (p) ms_free(p, 12345, 0, NULL);
    ms_free(keep, 3 * MiB, 0, NULL);
    ms_epoch();
    /* for the runner: the trace must hold exactly the parent's allocations */
    printf("    parent pid %d, parent allocations %ld\n", (int)getpid(),
           atomic_load(&g_fork_allocs) + 1 + (p != NULL));
}

/* ---- signal storms -------------------------------------------------------------------------- */

static atomic_long g_sigs;
static void on_signal(int sig)
{
    (void)sig;
    atomic_fetch_add_explicit(&g_sigs, 1, memory_order_relaxed);
}

static void *alloc_worker(void *arg)
{
    int id = (int)(uintptr_t)arg;
    uint64_t r = 991 + (uint64_t)id * 31;
    struct held h[8];
    memset(h, 0, sizeof h);
    while (!atomic_load(&g_stop)) {
        uint64_t x = rng_next(&r);
        struct held *b = &h[x % 8];
        if (b->p) {
            if (!pattern_ok(b->p, b->n, b->tag)) atomic_fetch_add(&g_corrupt, 1);
            if (b->pluggable) ms_free(b->p, (ssize_t)b->n, 0, NULL);
            else if (cudaFree(b->p) != cudaSuccess) atomic_fetch_add(&g_errors, 1);
            memset(b, 0, sizeof *b);
        } else {
            b->n = pick_size(x >> 8);
            b->tag = x;
            b->pluggable = (x >> 40) % 3 != 0;
            void *p = NULL;
            if (b->pluggable) {
                p = ms_malloc((ssize_t)b->n, 0, NULL);
                if (!p) atomic_fetch_add(&g_ooms, 1);
            } else {
                cudaError_t e = cudaMalloc(&p, b->n);
                if (e == cudaErrorMemoryAllocation) atomic_fetch_add(&g_ooms, 1);
                else if (e != cudaSuccess) atomic_fetch_add(&g_errors, 1);
                if (e != cudaSuccess) p = NULL;
            }
            if (!p) {
                memset(b, 0, sizeof *b);
                continue;
            }
            b->p = p;
            pattern_put(b->p, b->n, b->tag);
            atomic_fetch_add(&g_allocs, 1);
            if (id == 0 && atomic_load(&g_allocs) % 500 == 0) ms_epoch(); /* reports under fire */
        }
    }
    for (int i = 0; i < 8; i++) {
        if (!h[i].p) continue;
        if (!pattern_ok(h[i].p, h[i].n, h[i].tag)) atomic_fetch_add(&g_corrupt, 1);
        if (h[i].pluggable) ms_free(h[i].p, (ssize_t)h[i].n, 0, NULL);
        else if (cudaFree(h[i].p) != cudaSuccess) atomic_fetch_add(&g_errors, 1);
    }
    return NULL;
}

static void *kill_thread(void *arg)
{
    int sig = (int)(uintptr_t)arg;
    while (!atomic_load(&g_stop)) {
        kill(getpid(), sig);
        usleep(sig == SIGUSR2 ? 2000 : 50);
    }
    return NULL;
}

static void run_storm(int sig_kill, double secs, long *sent_before)
{
    pthread_t th[4], k;
    atomic_store(&g_stop, 0);
    for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, alloc_worker, (void *)(uintptr_t)i);
    pthread_create(&k, NULL, kill_thread, (void *)(uintptr_t)sig_kill);
    double end = now_s() + secs;
    while (now_s() < end) usleep(10000);
    atomic_store(&g_stop, 1);
    pthread_join(k, NULL);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    (void)sent_before;
}

TEST(signal_storm)
{
    REQUIRE(resolve());
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    void *p = ms_malloc(1, 0, NULL); /* memshim is up before the first signal */
    REQUIRE(p);
    ms_free(p, 1, 0, NULL);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0; /* SIGALRM without SA_RESTART: slow system calls see EINTR */
    REQUIRE(sigaction(SIGALRM, &sa, NULL) == 0);
    sa.sa_flags = SA_RESTART;
    REQUIRE(sigaction(SIGUSR1, &sa, NULL) == 0);
    struct itimerval it = {{0, 100}, {0, 100}};
    REQUIRE(setitimer(ITIMER_REAL, &it, NULL) == 0);
    double t0 = now_s();
    run_storm(SIGUSR1, run_seconds(), NULL);
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    ms_epoch();
    printf("    %.1f s: %ld signals handled (SIGALRM every 100 us, SIGUSR1 every 50 us) while 4 "
           "threads made %ld allocations (%ld OOM answers, %ld errors, %ld corrupted)\n",
           now_s() - t0, atomic_load(&g_sigs), atomic_load(&g_allocs), atomic_load(&g_ooms),
           atomic_load(&g_errors), atomic_load(&g_corrupt));
    CHECK(atomic_load(&g_sigs) > 1000);
    CHECK(atomic_load(&g_allocs) > 1000);
    CHECK(atomic_load(&g_errors) == 0);
    CHECK(atomic_load(&g_corrupt) == 0);
}

TEST(epoch_signal_storm)
{
    REQUIRE(resolve());
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    /* memshim installs its SIGUSR2 handler when it starts: before that SIGUSR2 would kill us */
    void *p = ms_malloc(1, 0, NULL);
    REQUIRE(p);
    ms_free(p, 1, 0, NULL);
    struct sigaction old;
    REQUIRE(sigaction(SIGUSR2, NULL, &old) == 0);
    REQUIRE(old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN);
    double t0 = now_s();
    run_storm(SIGUSR2, run_seconds(), NULL);
    printf("    %.1f s: SIGUSR2 every 2 ms while 4 threads made %ld allocations (%ld OOM answers, "
           "%ld errors, %ld corrupted)\n",
           now_s() - t0, atomic_load(&g_allocs), atomic_load(&g_ooms), atomic_load(&g_errors),
           atomic_load(&g_corrupt));
    CHECK(atomic_load(&g_allocs) > 1000);
    CHECK(atomic_load(&g_errors) == 0);
    CHECK(atomic_load(&g_corrupt) == 0);
}

TEST_MAIN()
