/*
 * nodriver.c: memshim preloaded into a process without a usable driver. With argument "cpu" it
 * never touches CUDA (a data-loader worker); otherwise it calls cudaMalloc and must get the
 * runtime's own error, and cudaFree(NULL)/cudaMemGetInfo must not crash. run_preload.sh runs it
 * with CUDBL_FAIL_INIT=1 and checks stderr: at most one info line, nothing at warning level.
 * This program does not use the harness: the script counts its exit status as one case.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "cpu")) {
        volatile double x = 0;
        for (int i = 0; i < 1000; i++) x += i;
        printf("cpu-only ok\n");
        return 0;
    }
    void *p = (void *)0x1;
    cudaError_t r = cudaMalloc(&p, 1 << 20);
    if (r == cudaSuccess) {
        printf("cudaMalloc succeeded without a usable driver\n");
        return 1;
    }
    size_t f, t;
    (void)cudaMemGetInfo(&f, &t);
    (void)cudaFree(NULL);
    printf("cudaMalloc -> %d (runtime error, as expected)\n", (int)r);
    return 0;
}
