/*
 * bench_front.c: what one alloc+free pair costs through the tensor-mode entry points
 * (memshim_torch_alloc / memshim_torch_free, the functions PyTorch's pluggable allocator calls),
 * next to glibc's malloc/free over the same size sequence in the same process (issue 30). Not a
 * test: tests/bench/bench_front.py runs it in rounds and prints the table `make bench` shows.
 *
 * Run under LD_PRELOAD=libmemshim.so with the CUDA driver double first on LD_LIBRARY_PATH (as
 * the preload suite runs its programs): the double serves the memory, the pages stay mapped after
 * the warm-up, so a cached pair makes no driver call, and the double counts any it makes.
 *
 *   bench_front PATTERN STREAM LIMIT THREADS [STEPS [WARMUP]]
 *     PATTERN  hit:    the same BLOCKS sizes every step (a training step repeating itself);
 *              small:  the same, sizes 512 B - 8 KiB only (glibc's thread cache serves them: the
 *                      strictest comparison);
 *              miss:   new sizes every step (no exact size comes back: the pool's general path);
 *              plan:   a step that does not fit best-fit under a limit just above its live
 *                      peak, so that the pool learns it and places by its plan (the learned-step
 *                      regime, where the front end steps aside)
 *     STREAM   default (the legacy stream, NULL) or side (a stream of the double's)
 *     LIMIT    none, or a factor of the step's live peak (1.1: set_per_process_memory_fraction
 *              to 1.1 x the live peak, as PyTorch's hook does)
 *     THREADS  1 or more threads on device 0, each on its own stream (STREAM=side) or all on the
 *              default stream
 * Each step of thread 0 ends with memshim_step(), as PyTorch's optimizer-step hook calls it (the front end's
 * bins are trimmed there, and under a limit it serves once two steps showed room); its cost is in
 * the figures, spread over the step's 100 pairs. Prints one JSON line: ns per pair (thread CPU time, the fastest of REPS timed runs, median
 * over the threads), glibc's the same way, and the driver calls the double counted (by kind) while the
 * timed runs ran (they must be 0 for hit and miss once warm).
 */
#include <cuda.h>
#include <dlfcn.h>
#include <malloc.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#define BLOCKS 100
#define REPS 5
#define MAXT 16
#define MiB ((size_t)1 << 20)

typedef void *(*alloc_fn)(ssize_t, int, void *);
typedef void (*free_fn)(void *, ssize_t, int, void *);
typedef void (*frac_fn)(double, int);
typedef long (*count_fn)(const char *);

static alloc_fn t_alloc;
static free_fn t_free;
static void (*t_step)(void); /* memshim_step: an optimizer step ends (PyTorch's hook calls it) */
static const char *pattern = "hit";
static int steps = 200, warmup = 6;
static pthread_barrier_t bar;

static uint64_t rng(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* PyTorch-like: most tensors 512 B - 1 MiB (activations, small params, grads), a few larger. */
static size_t mix_size(uint64_t *s)
{
    uint64_t x = rng(s);
    if (!strcmp(pattern, "small")) return 512 + x % (8 * 1024 - 512);
    unsigned b = (unsigned)(x % 100);
    x >>= 8;
    if (b < 55) return 512 + x % (64 * 1024);
    if (b < 85) return 64 * 1024 + x % (960 * 1024);
    if (b < 97) return MiB + x % (7 * MiB);
    return 8 * MiB + x % (16 * MiB);
}

static double cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

struct worker {
    void *stream;
    uint64_t seed;
    size_t sizes[BLOCKS];
    int order[BLOCKS]; /* the free order of a step: half LIFO, half random */
    double ns, glibc_ns;
    int failed;
    bool first; /* thread 0: it marks the steps (a job's optimizer runs on one thread) */
};

static void new_step_sizes(struct worker *w, bool fresh)
{
    uint64_t s = w->seed;
    for (int i = 0; i < BLOCKS; i++) w->sizes[i] = mix_size(&s);
    if (fresh) w->seed = s; /* miss: the next step draws other sizes */
}

static void new_order(struct worker *w)
{
    for (int i = 0; i < BLOCKS; i++) w->order[i] = BLOCKS - 1 - i;
    uint64_t s = w->seed ^ 0x5151;
    for (int i = BLOCKS / 2; i < BLOCKS; i++) { /* shuffle the second half */
        int j = i + (int)(rng(&s) % (uint64_t)(BLOCKS - i));
        int t = w->order[i];
        w->order[i] = w->order[j];
        w->order[j] = t;
    }
}

/* One step through memshim: every block allocated, then freed in the step's order. The plan
 * pattern interleaves: each block after the first few frees the one allocated two before it, so
 * that best-fit online leaves holes the step's next sizes do not fit. */
static int step_memshim(struct worker *w)
{
    void *p[BLOCKS];
    bool miss = !strcmp(pattern, "miss");
    if (miss) new_step_sizes(w, true);
    if (!strcmp(pattern, "plan")) {
        for (int i = 0; i < BLOCKS; i++) {
            if (!(p[i] = t_alloc((ssize_t)w->sizes[i], 0, w->stream))) return -1;
            if (i >= 2 && i % 3) {
                t_free(p[i - 2], (ssize_t)w->sizes[i - 2], 0, w->stream);
                p[i - 2] = NULL;
            }
        }
        for (int i = BLOCKS - 1; i >= 0; i--)
            if (p[i]) t_free(p[i], (ssize_t)w->sizes[i], 0, w->stream);
        if (w->first) t_step();
        return 0;
    }
    for (int i = 0; i < BLOCKS; i++)
        if (!(p[i] = t_alloc((ssize_t)w->sizes[i], 0, w->stream))) return -1;
    for (int k = 0; k < BLOCKS; k++) t_free(p[w->order[k]], (ssize_t)w->sizes[w->order[k]], 0, w->stream);
    if (w->first) t_step(); /* the step's end, as PyTorch's optimizer hook marks it (one thread) */
    return 0;
}

/* The same sizes and order through glibc. */
static void step_glibc(struct worker *w)
{
    void *p[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) {
        p[i] = malloc(w->sizes[i]);
        *(volatile char *)p[i] = 1; /* malloc's block is used, as a tensor's would be */
    }
    for (int k = 0; k < BLOCKS; k++) free(p[w->order[k]]);
}

static void *run(void *arg)
{
    struct worker *w = arg;
    new_step_sizes(w, false);
    new_order(w);
    for (int s = 0; s < warmup; s++) /* warm-up: pages mapped, a plan learned, the front end past its wait */
        if (step_memshim(w)) w->failed = 1;
    uint64_t seed0 = w->seed;
    pthread_barrier_wait(&bar);
    double best = 1e300, gbest = 1e300;
    for (int r = 0; r < REPS && !w->failed; r++) {
        double t0 = cpu_ns();
        for (int s = 0; s < steps; s++)
            if (step_memshim(w)) w->failed = 1;
        double t1 = cpu_ns();
        if (t1 - t0 < best) best = t1 - t0;
    }
    pthread_barrier_wait(&bar); /* the driver-call window ends here */
    uint64_t seed1 = w->seed;
    w->seed = seed0; /* glibc sees the same sizes */
    for (int r = 0; r < REPS; r++) {
        double t0 = cpu_ns();
        for (int s = 0; s < steps; s++) {
            if (!strcmp(pattern, "miss")) new_step_sizes(w, true);
            step_glibc(w);
        }
        double t1 = cpu_ns();
        if (t1 - t0 < gbest) gbest = t1 - t0;
    }
    w->seed = seed1;
    w->ns = best / ((double)steps * BLOCKS);
    w->glibc_ns = gbest / ((double)steps * BLOCKS);
    return NULL;
}

/* The live bytes a step holds at its peak (512-byte rounded, as PyTorch and the pool round). */
static size_t step_peak(const struct worker *w)
{
    size_t live = 0, peak = 0;
    bool plan = !strcmp(pattern, "plan");
    for (int i = 0; i < BLOCKS; i++) {
        live += (w->sizes[i] + 511) / 512 * 512;
        if (live > peak) peak = live;
        if (plan && i >= 2 && i % 3) live -= (w->sizes[i - 2] + 511) / 512 * 512;
    }
    return peak;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static const char *const FNS[] = {"cuMemCreate", "cuMemMap", "cuMemUnmap", "cuMemRelease", "cuMemSetAccess",
                                  "cuEventRecord", "cuEventQuery", "cuStreamWaitEvent", "cuCtxSynchronize",
                                  "cuStreamSynchronize", "cuStreamIsCapturing", "cuThreadExchangeStreamCaptureMode",
                                  "cuMemGetInfo", "cuStreamGetCtx", "cuCtxGetCurrent"};
#define NFN (sizeof FNS / sizeof *FNS)

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s hit|small|miss|plan default|side none|FACTOR THREADS [STEPS [WARMUP]]\n", argv[0]);
        return 2;
    }
    pattern = argv[1];
    bool side = !strcmp(argv[2], "side");
    double factor = strcmp(argv[3], "none") ? atof(argv[3]) : 0;
    int nt = atoi(argv[4]);
    if (argc > 5) steps = atoi(argv[5]);
    if (argc > 6) warmup = atoi(argv[6]);
    if (nt < 1 || nt > MAXT || steps < 1) return 2;
    *(void **)&t_alloc = dlsym(RTLD_DEFAULT, "memshim_torch_alloc");
    *(void **)&t_free = dlsym(RTLD_DEFAULT, "memshim_torch_free");
    *(void **)&t_step = dlsym(RTLD_DEFAULT, "memshim_step");
    frac_fn frac;
    *(void **)&frac = dlsym(RTLD_DEFAULT, "memshim_torch_set_memory_fraction");
    count_fn calls;
    *(void **)&calls = dlsym(RTLD_DEFAULT, "cudbl_call_count");
    if (!t_alloc || !t_free || !t_step || !frac || !calls) {
        fprintf(stderr, "bench_front: run under LD_PRELOAD=libmemshim.so with the driver double on LD_LIBRARY_PATH\n");
        return 2;
    }
    /* glibc from its heap, as a steady loop finds it: no mmap per large block, no trim */
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    CUdevice dev;
    CUcontext ctx;
    size_t total = 0;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx) ||
        cuDeviceTotalMem(&total, dev))
        return 3;
    static struct worker w[MAXT];
    size_t peak = 0;
    for (int t = 0; t < nt; t++) {
        w[t].seed = 0x1234567ull + (uint64_t)t * 7919;
        w[t].first = t == 0;
        if (side && cuStreamCreate((CUstream *)&w[t].stream, CU_STREAM_NON_BLOCKING)) return 3;
        new_step_sizes(&w[t], false);
        peak += step_peak(&w[t]);
    }
    if (factor > 0) frac(factor * (double)peak / (double)total, 0);
    pthread_barrier_init(&bar, NULL, (unsigned)nt + 1);
    pthread_t th[MAXT];
    for (int t = 0; t < nt; t++) pthread_create(&th[t], NULL, run, &w[t]);
    pthread_barrier_wait(&bar);
    long before[NFN], other = 0;
    for (size_t f = 0; f < NFN; f++) before[f] = calls(FNS[f]);
    pthread_barrier_wait(&bar);
    char kinds[1024] = "";
    size_t kl = 0;
    for (size_t f = 0; f < NFN; f++) {
        long d = calls(FNS[f]) - before[f];
        other += d;
        if (d && kl < sizeof kinds - 64)
            kl += (size_t)snprintf(kinds + kl, sizeof kinds - kl, "%s\"%s\": %ld", kl ? ", " : "", FNS[f], d);
    }
    for (int t = 0; t < nt; t++) pthread_join(th[t], NULL);
    double ns[MAXT], gns[MAXT];
    int failed = 0;
    for (int t = 0; t < nt; t++) {
        ns[t] = w[t].ns;
        gns[t] = w[t].glibc_ns;
        failed |= w[t].failed;
    }
    qsort(ns, (size_t)nt, sizeof *ns, cmp_d);
    qsort(gns, (size_t)nt, sizeof *gns, cmp_d);
    printf("{\"pattern\": \"%s\", \"stream\": \"%s\", \"limit\": \"%s\", \"threads\": %d, \"ns\": %.2f, "
           "\"glibc_ns\": %.2f, \"driver_calls\": %ld, \"calls\": {%s}, \"live_peak\": %zu, \"failed\": %s}\n",
           pattern, side ? "side" : "default", argv[3], nt, ns[nt / 2], gns[nt / 2], other, kinds, peak,
           failed ? "true" : "false");
    return failed;
}
