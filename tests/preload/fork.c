/*
 * fork.c: a process that forks while another thread is allocating through memshim. The child must
 * not deadlock on a lock the allocating thread held at fork time: it allocates and frees (memshim
 * passes through in a child; whatever the driver answers is fine) and exits 0. The parent goes
 * on allocating and its data stays intact. A child does not keep the parent's trace file open (it
 * writes no trace; an open descriptor would pin the file and leak into whatever the child runs).
 */
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static atomic_int stop;
static atomic_long worker_errors, worker_ops;

static void *worker(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    while (!atomic_load(&stop)) {
        void *p = NULL;
        size_t sz = 4096 + (size_t)(seed = seed * 1103515245u + 12345u) % (1 << 20);
        if (cudaMalloc(&p, sz) != cudaSuccess) { atomic_fetch_add(&worker_errors, 1); continue; }
        memset(p, 0x11, sz < 4096 ? sz : 4096);
        if (((unsigned char *)p)[0] != 0x11) atomic_fetch_add(&worker_errors, 1);
        if (cudaFree(p) != cudaSuccess) atomic_fetch_add(&worker_errors, 1);
        atomic_fetch_add(&worker_ops, 1);
    }
    return NULL;
}

/* In the child: allocate and free once, never block forever. */
static void child_body(void)
{
    alarm(5); /* a deadlock becomes SIGALRM, which the parent sees */
    void *p = NULL;
    if (cudaMalloc(&p, 65536) == cudaSuccess && p) cudaFree(p);
    cudaFree(NULL);
    _exit(0);
}

TEST(fork_while_allocating)
{
    void *keep = NULL;
    REQUIRE(cudaMalloc(&keep, 1 << 20) == cudaSuccess);
    memset(keep, 0x77, 1 << 20);
    pthread_t th[2];
    for (int i = 0; i < 2; i++) REQUIRE(pthread_create(&th[i], NULL, worker, (void *)(uintptr_t)(i + 1)) == 0);
    int children_ok = 0, nchildren = 12;
    for (int i = 0; i < nchildren; i++) {
        while (atomic_load(&worker_ops) < (long)(i + 1) * 5) usleep(100);
        pid_t pid = fork();
        if (pid == 0) child_body();
        REQUIRE(pid > 0);
        int status = 0;
        if (waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0)
            children_ok++;
        else
            fprintf(stderr, "    child %d: %s (status 0x%x)\n", i,
                    WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM ? "hung in a CUDA call" : "failed", status);
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    CHECKF(children_ok == nchildren, "%d of %d children exited 0", children_ok, nchildren);
    CHECK(atomic_load(&worker_errors) == 0);
    /* the parent still works and its data is intact */
    const unsigned char *k = keep;
    int intact = 1;
    for (size_t i = 0; i < (1 << 20); i++) intact &= k[i] == 0x77;
    CHECK(intact);
    void *p = NULL;
    CHECK(cudaMalloc(&p, 12345) == cudaSuccess);
    CHECK(cudaFree(p) == cudaSuccess);
    CHECK(cudaFree(keep) == cudaSuccess);
}

/* Whether this process has a descriptor open on the file at `path`. */
static int has_open(const char *path)
{
    char want[PATH_MAX], link[PATH_MAX], got[PATH_MAX];
    if (!realpath(path, want)) return -1;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int found = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(link, got, sizeof got - 1);
        if (n <= 0) continue;
        got[n] = '\0';
        if (strcmp(got, want) == 0) found = 1;
    }
    closedir(d);
    return found;
}

TEST(a_forked_child_does_not_keep_the_trace_open)
{
    const char *trace = getenv("TRACE"); /* run_preload.sh: MEMSHIM_TRACE_FILE's path */
    REQUIRE(trace && *trace);
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 4096) == cudaSuccess);
    CHECKF(has_open(trace) == 1, "the parent holds no descriptor on %s: nothing to tell apart", trace);
    pid_t pid = fork();
    if (pid == 0) _exit(has_open(trace) == 0 ? 0 : 3);
    REQUIRE(pid > 0);
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    CHECKF(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child %s the trace file open (status 0x%x)",
           WIFEXITED(status) && WEXITSTATUS(status) == 3 ? "keeps" : "could not look whether it keeps", status);
    CHECK(cudaFree(p) == cudaSuccess);
}

TEST_MAIN()
