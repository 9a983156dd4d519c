/*
 * soak.c: reli-soak, the soak test of issue 5. Under LD_PRELOAD=libmemshim.so on the CUDA doubles,
 * it replays memshim text traces (converted from the real PyTorch snapshots in ../shared/traces by
 * `memshim-replay --to-text`) through memshim's entry points, pass after pass, until it has made
 * RELI_SOAK_OPS operations (default 1000000, allocations and frees counted separately):
 * every eighth block through cudaMalloc/cudaFree (segment mode), the others through
 * memshim_malloc/memshim_free on the stream the trace names (stream 0 stays the legacy stream,
 * others map onto two created streams). Each block carries a pattern in its first 8 bytes and its
 * last byte, checked when it is freed. memshim_epoch() closes an epoch every RELI_SOAK_EPOCH_OPS
 * operations (default 50000), so with MEMSHIM_REPORT_DIR set a report is written each time. At the
 * end of each pass every block is freed.
 *
 * Sampled at the end of every pass (everything freed): host RSS less shared pages (/proc/self/statm:
 * the double's device memory is a memfd, so it is not counted as host memory), open file
 * descriptors (/proc/self/fd) and the double's live handles and mappings. Pass 1 is the warm-up;
 * after it, asserted: RSS at most RELI_SOAK_RSS_SLACK_MIB (default 16) above its value after pass
 * 1, the same number of file descriptors, at most 1% more handles and mappings than after pass 1
 * (the pool's cached pages are reused; the stream tags a pass leaves shape the next pass's layout,
 * which settles within a few passes), and none added over the second half of the passes (a leak
 * grows every pass). Also: no pattern corrupted, no allocation
 * failed (the double's capacity is set above the largest trace's needs).
 *
 * usage: reli-soak TRACE.txt...   Prints one line per pass and ends with the harness summary.
 */
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cudbl.h"

struct ev {
    char op; /* 'a' (prefix or alloc) or 'f' */
    uint64_t addr, size, stream;
};
struct trace {
    const char *name;
    struct ev *ev;
    size_t n;
};

struct slot { /* live block of the replay, keyed by its address in the recording */
    uint64_t key, tag;
    unsigned char *p;
    size_t n;
    cudaStream_t s;
    uint8_t used, runtime;
};

static void *(*ms_malloc)(ssize_t, int, void *);
static void (*ms_free)(void *, ssize_t, int, void *);
static void (*ms_epoch)(void);

#define HBITS 20
static struct slot *tab;

static struct slot *find(uint64_t key, int insert)
{
    size_t m = ((size_t)1 << HBITS) - 1, i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - HBITS));
    for (;; i = (i + 1) & m) {
        if (!tab[i].used) return insert ? &tab[i] : NULL;
        if (tab[i].key == key) return &tab[i];
    }
}

static void erase(struct slot *s)
{
    /* backward-shift deletion keeps linear probing correct */
    size_t m = ((size_t)1 << HBITS) - 1, i = (size_t)(s - tab), j = i;
    tab[i].used = 0;
    for (;;) {
        j = (j + 1) & m;
        if (!tab[j].used) return;
        size_t h = (size_t)((tab[j].key * 0x9E3779B97F4A7C15ull) >> (64 - HBITS));
        if ((j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j))) {
            tab[i] = tab[j];
            tab[j].used = 0;
            i = j;
        }
    }
}

static int load(const char *path, struct trace *t)
{
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    size_t cap = 1 << 16;
    t->name = path;
    t->ev = malloc(cap * sizeof *t->ev);
    t->n = 0;
    char line[512];
    while (t->ev && fgets(line, sizeof line, f)) {
        char op;
        int dev;
        unsigned long long st, addr, size;
        if (line[0] != 'a' && line[0] != 'f' && line[0] != 'p') continue;
        if (sscanf(line, "%c %d %llx %llx %llu", &op, &dev, &st, &addr, &size) != 5) continue;
        if (t->n == cap) {
            cap *= 2;
            struct ev *nv = realloc(t->ev, cap * sizeof *t->ev);
            if (!nv) break;
            t->ev = nv;
        }
        /* devices are folded onto device 0; keep them apart by address */
        t->ev[t->n++] = (struct ev){op == 'f' ? 'f' : 'a', addr ^ ((uint64_t)dev << 60), size, st};
    }
    fclose(f);
    return t->ev && t->n ? 0 : 1;
}

/* Host memory the process holds of its own: resident pages less the shared ones. The double keeps
 * device memory in a memfd (shared pages, counted apart), so the pages a placement happens to
 * touch are device memory, not host memory memshim holds; libraries' file pages are shared too. */
static long rss_kib(void)
{
    long pages = 0, res = 0, shared = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%ld %ld %ld", &pages, &res, &shared) != 3) res = shared = 0;
        fclose(f);
    }
    return (res - shared) * (sysconf(_SC_PAGESIZE) / 1024);
}

static int open_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1; /* the directory stream itself */
}

static int intact(const struct slot *s)
{
    uint64_t w;
    if (s->n >= 9) {
        memcpy(&w, s->p, 8);
        if (w != s->tag) return 0;
    }
    return s->p[s->n - 1] == (unsigned char)s->tag;
}

static long env_long(const char *name, long def)
{
    const char *v = getenv(name);
    return v && *v ? atol(v) : def;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s TRACE.txt...\n", argv[0]);
        return 2;
    }
    *(void **)&ms_malloc = dlsym(RTLD_DEFAULT, "memshim_malloc");
    *(void **)&ms_free = dlsym(RTLD_DEFAULT, "memshim_free");
    *(void **)&ms_epoch = dlsym(RTLD_DEFAULT, "memshim_epoch");
    if (!ms_malloc || !ms_free || !ms_epoch) {
        printf("FAIL soak: memshim is not preloaded\n0 passed, 1 failed, 0 skipped\n");
        return 1;
    }
    long target = env_long("RELI_SOAK_OPS", 1000000), epoch_ops = env_long("RELI_SOAK_EPOCH_OPS", 50000);
    long slack_kib = env_long("RELI_SOAK_RSS_SLACK_MIB", 16) * 1024;
    int ntr = argc - 1;
    struct trace *tr = calloc((size_t)ntr, sizeof *tr);
    tab = calloc((size_t)1 << HBITS, sizeof *tab);
    if (!tr || !tab) return 1;
    size_t per_pass = 0;
    for (int i = 0; i < ntr; i++) {
        if (load(argv[i + 1], &tr[i])) {
            printf("FAIL soak: cannot read %s\n0 passed, 1 failed, 0 skipped\n", argv[i + 1]);
            return 1;
        }
        per_pass += tr[i].n;
    }
    if (cudaSetDevice(0) != cudaSuccess || cudaFree(NULL) != cudaSuccess) {
        printf("FAIL soak: no device\n0 passed, 1 failed, 0 skipped\n");
        return 1;
    }
    cudaStream_t streams[2];
    if (cudaStreamCreate(&streams[0]) != cudaSuccess || cudaStreamCreate(&streams[1]) != cudaSuccess) return 1;
    printf("    %d traces, %zu operations per pass; target %ld operations, an epoch every %ld\n", ntr,
           per_pass, target, epoch_ops);

    long ops = 0, fails = 0, corrupt = 0, epochs = 0, runtime_blocks = 0, unknown_free = 0;
    long rss0 = 0, fd0 = 0, h0 = 0, m0 = 0, rss_max = 0, worst_rss = 0, worst_fd = 0, worst_h = 0, worst_m = 0;
    int pass = 0, bad_pass = 0;
    long hist_h[64], hist_m[64]; /* handles and mappings after each pass (the first 64) */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint64_t tagseq = 1;
    while (ops < target) {
        pass++;
        for (int t = 0; t < ntr && ops < target; t++) {
            for (size_t i = 0; i < tr[t].n; i++) {
                const struct ev *e = &tr[t].ev[i];
                if (e->op == 'a') {
                    struct slot *s = find(e->addr, 1);
                    if (s->used) { /* cannot happen in a reader-checked trace; keep going */
                        unknown_free++;
                        continue;
                    }
                    size_t n = e->size ? (size_t)e->size : 1;
                    cudaStream_t st = e->stream ? streams[(e->stream >> 4) & 1] : 0;
                    int rt = (tagseq % 8) == 0;
                    void *p = NULL;
                    if (rt) {
                        if (cudaMalloc(&p, n) != cudaSuccess) p = NULL;
                    } else {
                        p = ms_malloc((ssize_t)n, 0, st);
                    }
                    ops++;
                    if (!p) {
                        fails++;
                        continue;
                    }
                    uint64_t tag = tagseq++ * 0x9E3779B97F4A7C15ull;
                    *s = (struct slot){e->addr, tag, p, n, st, 1, (uint8_t)rt};
                    runtime_blocks += rt;
                    if (n >= 9) memcpy(p, &tag, 8);
                    ((unsigned char *)p)[n - 1] = (unsigned char)tag;
                } else {
                    struct slot *s = find(e->addr, 0);
                    if (!s) { /* its allocation failed, or a free of something never seen */
                        unknown_free++;
                        continue;
                    }
                    ops++;
                    struct slot b = *s;
                    erase(s);
                    if (!intact(&b)) corrupt++;
                    if (b.runtime) {
                        if (cudaFree(b.p) != cudaSuccess) fails++;
                    } else {
                        ms_free(b.p, (ssize_t)b.n, 0, b.s);
                    }
                }
                if (epoch_ops > 0 && ops % epoch_ops == 0) {
                    ms_epoch();
                    epochs++;
                }
                if (ops >= target) break;
            }
            /* end of a trace: free what is left, as a training loop's step does */
            size_t m = (size_t)1 << HBITS;
            for (size_t i = 0; i < m; i++) {
                if (!tab[i].used) continue;
                if (!intact(&tab[i])) corrupt++;
                if (tab[i].runtime) cudaFree(tab[i].p);
                else ms_free(tab[i].p, (ssize_t)tab[i].n, 0, tab[i].s);
                tab[i].used = 0;
                ops++;
            }
        }
        cudaDeviceSynchronize();
        struct cudbl_counts k;
        cudbl_get_counts(&k);
        long rss = rss_kib(), fds = open_fds();
        if (rss > rss_max) rss_max = rss;
        if (pass == 1) {
            rss0 = rss, fd0 = fds, h0 = k.handles, m0 = k.mappings;
        } else {
            if (rss - rss0 > worst_rss) worst_rss = rss - rss0;
            if (fds - fd0 > worst_fd) worst_fd = fds - fd0;
            if (k.handles - h0 > worst_h) worst_h = k.handles - h0;
            if (k.mappings - m0 > worst_m) worst_m = k.mappings - m0;
            if (rss - rss0 > slack_kib || fds != fd0 || k.handles - h0 > h0 / 100 || k.mappings - m0 > m0 / 100)
                bad_pass++;
        }
        if (pass <= 64) hist_h[pass - 1] = k.handles, hist_m[pass - 1] = k.mappings;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        printf("    pass %d: %ld operations so far (%.1f s), host RSS %ld KiB, fds %ld, handles %ld, "
               "mappings %ld, reservations %ld\n",
               pass, ops, (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9, rss, fds,
               k.handles, k.mappings, k.reservations);
        fflush(stdout);
    }
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    int passed = 0, failed = 0;
#define CASE(cond, ...)                                   \
    do {                                                  \
        if (cond) passed++, printf("ok   " __VA_ARGS__);  \
        else failed++, printf("FAIL " __VA_ARGS__);       \
        printf("\n");                                     \
    } while (0)
    CASE(ops >= target, "soak: %ld operations in %d passes, %.1f s (%.0f ops/s), %ld through cudaMalloc, "
         "%ld epochs", ops, pass, secs, ops / secs, runtime_blocks, epochs);
    CASE(fails == 0, "soak: no allocation or free failed (%ld failed)", fails);
    CASE(corrupt == 0, "soak: every block intact when freed (%ld corrupted)", corrupt);
    CASE(pass >= 2, "soak: at least one pass after the warm-up (%d passes)", pass);
    /* a leak grows every pass; the layout only settles: the tags one pass leaves shape where the
     * next pass's blocks go, so a pass may map a page that the first did not, a few times */
    int np = pass < 64 ? pass : 64, mid = (np + 1) / 2, late_growth = 0;
    for (int i = mid; i < np; i++)
        if (hist_h[i] > hist_h[mid - 1] || hist_m[i] > hist_m[mid - 1]) late_growth++;
    CASE(late_growth == 0, "soak: no growth over the second half: handles %ld and mappings %ld after pass %d, "
         "%ld and %ld after pass %d", hist_h[mid - 1], hist_m[mid - 1], mid, hist_h[np - 1], hist_m[np - 1], np);
    CASE(bad_pass == 0,
         "soak: flat after the warm-up pass: RSS at most +%ld KiB (worst +%ld KiB), fds +0 (worst +%ld), "
         "handles at most +%ld (worst %+ld), mappings at most +%ld (worst %+ld); %d passes over",
         slack_kib, worst_rss, worst_fd, h0 / 100, worst_h, m0 / 100, worst_m, bad_pass);
    printf("soak: %d passed, %d failed, 0 skipped\n", passed, failed);
    return failed ? 1 : 0;
}
