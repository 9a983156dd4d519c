/*
 * epoch_seconds_race.c: with MEMSHIM_EPOCH=seconds every allocating thread sees the deadline pass;
 * exactly one may close the epoch (found by review: 8 threads closed about 8 epochs at each
 * boundary, most of them 0 s long). A job that goes quiet past a deadline has that epoch closed by
 * memshim's watcher thread, once, and the watcher then sleeps: an idle job burns no CPU. Run under
 * LD_PRELOAD=libmemshim.so with MEMSHIM_EPOCH=seconds MEMSHIM_EPOCH_SECONDS=0.5
 * MEMSHIM_REPORT_DIR=$REPORTS.
 */
#include <cuda_runtime_api.h>
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    double end = *(double *)arg;
    while (now_s() < end) {
        void *p = NULL;
        if (cudaMalloc(&p, 4096) == cudaSuccess) cudaFree(p);
    }
    return NULL;
}

static int epoch_reports(const char *dir)
{
    int epochs = 0;
    DIR *d = opendir(dir);
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));)
        if (strstr(e->d_name, "-epoch") && !strstr(e->d_name, ".tmp")) epochs++;
    closedir(d);
    return epochs;
}

static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

TEST(one_epoch_per_deadline_whatever_the_threads)
{
    const char *dir = getenv("REPORTS");
    REQUIRE(dir != NULL);
    void *warm = NULL;
    REQUIRE(cudaMalloc(&warm, 4096) == cudaSuccess);
    cudaFree(warm);
    double end = now_s() + 1.8; /* three boundaries of 0.5 s at most */
    pthread_t th[8];
    for (int i = 0; i < 8; i++) pthread_create(&th[i], NULL, worker, &end);
    for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
    int epochs = epoch_reports(dir);
    REQUIRE(epochs >= 0);
    printf("    8 threads for 1.8 s with 0.5 s epochs: %d epoch reports\n", epochs);
    CHECK(epochs >= 2 && epochs <= 4);
}

/* A quiet phase (evaluation on the CPU, a data stall): the watcher closes each epoch once it is
 * GRACE past its deadline, one per deadline, and sleeps in between. */
TEST(an_idle_job_gets_one_epoch_per_deadline_and_no_cpu_is_burnt)
{
    const char *dir = getenv("REPORTS");
    REQUIRE(dir != NULL);
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 4096) == cudaSuccess); /* work in the epoch now in progress */
    cudaFree(p);
    int before = epoch_reports(dir);
    double c0 = cpu_s(), t0 = now_s();
    struct timespec idle = {1, 600000000}; /* three deadlines of 0.5 s */
    while (nanosleep(&idle, &idle) != 0) {}
    double cpu = cpu_s() - c0, wall = now_s() - t0;
    int after = epoch_reports(dir);
    printf("    %.2f s idle: %.3f s of CPU, %d epoch reports written\n", wall, cpu, after - before);
    CHECKF(after - before >= 2 && after - before <= 4, "%d epoch reports in %.2f s idle with 0.5 s epochs",
           after - before, wall);
    CHECKF(cpu < 0.25, "%.3f s of CPU in %.2f s idle", cpu, wall);
}

TEST_MAIN()
