/*
 * epoch_seconds_race.c: with MEMSHIM_EPOCH=seconds every allocating thread sees the deadline pass;
 * exactly one may close the epoch (found by review: 8 threads closed about 8 epochs at each
 * boundary, most of them 0 s long). Run under LD_PRELOAD=libmemshim.so with
 * MEMSHIM_EPOCH=seconds MEMSHIM_EPOCH_SECONDS=0.5 MEMSHIM_REPORT_DIR=$REPORTS.
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
    int epochs = 0;
    DIR *d = opendir(dir);
    REQUIRE(d != NULL);
    for (struct dirent *e; (e = readdir(d));)
        if (strstr(e->d_name, "-epoch") && !strstr(e->d_name, ".tmp")) epochs++;
    closedir(d);
    printf("    8 threads for 1.8 s with 0.5 s epochs: %d epoch reports\n", epochs);
    CHECK(epochs >= 2 && epochs <= 4);
}

TEST_MAIN()
