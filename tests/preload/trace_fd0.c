/*
 * trace_fd0.c: MEMSHIM_TRACE_FILE in a program started with its standard input closed (a daemon,
 * a job whose launcher closed it): the trace file then gets descriptor 0, and must record every
 * allocation and free like any other. The test runs this binary again as a child (exec'd, stdin
 * closed, its own trace path) and reads the trace. Added for the generated mutant
 * shim/core.c#004fcb79 of issue 18 (`trace_fd >= 0` taken as `trace_fd != 0`).
 */
#include <cuda_runtime_api.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define N 10

static char self[4096];

TEST(a_trace_on_descriptor_0_records_every_allocation_and_free)
{
    char dir[] = "/tmp/msh-tracefd0-XXXXXX";
    REQUIRE(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/trace.txt", dir);
    pid_t pid = fork();
    if (pid == 0) {
        close(0); /* the child starts with no standard input */
        setenv("MEMSHIM_TRACE_FILE", path, 1);
        execl(self, self, "child", (char *)NULL);
        _exit(127);
    }
    REQUIRE(pid > 0);
    int st = 0;
    REQUIRE(waitpid(pid, &st, 0) == pid);
    CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status 0x%x%s", st,
           WIFEXITED(st) && WEXITSTATUS(st) == 4 ? " (its trace is not on descriptor 0)" : "");
    FILE *f = fopen(path, "r");
    CHECKF(f != NULL, "no trace at %s", path);
    int allocs = 0, frees = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f)) {
        if (line[0] == 'a' && line[1] == ' ') allocs++;
        if (line[0] == 'f' && line[1] == ' ') frees++;
    }
    if (f) fclose(f);
    CHECKF(allocs == N && frees == N, "%d allocations and %d frees in the trace, %d of each made", allocs, frees, N);
    unlink(path);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "child")) {
        for (int i = 0; i < N; i++) {
            void *p = NULL;
            if (cudaMalloc(&p, (size_t)(i + 1) << 16) != cudaSuccess) return 2;
            if (cudaFree(p) != cudaSuccess) return 3;
            if (i == 0) { /* the test means something only if the trace is descriptor 0 */
                char got[4096], want[4096];
                ssize_t k = readlink("/proc/self/fd/0", got, sizeof got - 1);
                const char *t = getenv("MEMSHIM_TRACE_FILE");
                if (k <= 0 || !t || !realpath(t, want)) return 4;
                got[k] = 0;
                if (strcmp(got, want)) return 4;
            }
        }
        return 0;
    }
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 1;
    self[n] = 0;
    return th_main(__FILE__, argc, argv);
}
