/*
 * gil_latency.c: the allocating side of tests/bench/bench_gil.py. Loaded with ctypes.CDLL (so the
 * calling Python thread releases the GIL, as PyTorch's operators do before they allocate), it
 * times memshim_malloc one call at a time with the wall clock (waiting for the GIL is what is
 * measured: a CPU-time clock would not see it), a fixed gap apart (an operator every so often),
 * either on the calling thread (the main thread inside an operator: its Python frames above) or on
 * a new thread that holds an idle Python thread state and no frames (what autograd's device
 * threads do: PyGILState_Ensure once, then release the GIL and keep the state). CPython is reached
 * through dlsym: no Python headers needed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

typedef void *(*malloc_fn)(ssize_t, int, void *);
typedef void (*free_fn)(void *, ssize_t, int, void *);

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct job {
    malloc_fn m;
    free_fn f;
    int n;
    uint64_t gap_ns, size;
    uint64_t *lat;
};

static void loop(struct job *j)
{
    for (int i = 0; i < j->n; i++) {
        uint64_t t0 = now_ns();
        void *p = j->m((ssize_t)j->size, 0, NULL);
        j->lat[i] = now_ns() - t0;
        j->f(p, (ssize_t)j->size, 0, NULL);
        for (uint64_t until = now_ns() + j->gap_ns; now_ns() < until;) {
        }
    }
}

/* On the calling thread (CDLL: the GIL is released, the caller's Python frames stay above). */
int run_here(void *m, void *f, int n, unsigned long long gap_ns, unsigned long long size, uint64_t *lat)
{
    struct job j = {(malloc_fn)m, (free_fn)f, n, gap_ns, size, lat};
    loop(&j);
    return 0;
}

static void *idle_state_thread(void *arg)
{
    int (*ensure)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Ensure");
    void (*release)(int) = (void (*)(int))dlsym(RTLD_DEFAULT, "PyGILState_Release");
    void *(*save)(void) = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyEval_SaveThread");
    void (*restore)(void *) = (void (*)(void *))dlsym(RTLD_DEFAULT, "PyEval_RestoreThread");
    if (!ensure || !release || !save || !restore) return (void *)1;
    int g = ensure();     /* a thread state for life, as PythonEngine::thread_init makes */
    void *ts = save();    /* ... and the GIL released: no Python frame on this thread */
    loop(arg);
    restore(ts);
    release(g);
    return NULL;
}

/* On a new thread with an idle Python thread state. */
int run_thread(void *m, void *f, int n, unsigned long long gap_ns, unsigned long long size, uint64_t *lat)
{
    struct job j = {(malloc_fn)m, (free_fn)f, n, gap_ns, size, lat};
    pthread_t th;
    if (pthread_create(&th, NULL, idle_state_thread, &j)) return -1;
    void *rc = NULL;
    pthread_join(th, &rc);
    return rc ? -1 : 0;
}
