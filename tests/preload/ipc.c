/*
 * ipc.c: legacy CUDA IPC on pool memory (issue 8, item 4). VMM memory cannot be exported with
 * cudaIpcGetMemHandle/cuIpcGetMemHandle (the driver double refuses it, as a GPU does), so memshim
 * refuses it with cudaErrorNotSupported / CUDA_ERROR_NOT_SUPPORTED and one log line naming
 * memshim and MEMSHIM_MODE=off (run_preload.sh checks the line). With EXPECT_OFF=1 the program
 * runs under MEMSHIM_MODE=off, where cudaMalloc memory is the driver's and IPC works.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "harness.h"

TEST(legacy_ipc_of_pool_memory)
{
    int off = getenv("EXPECT_OFF") != NULL;
    void *p = NULL;
    REQUIRE(cudaMalloc(&p, 4u << 20) == cudaSuccess);
    cudaIpcMemHandle_t h;
    cudaError_t r = cudaIpcGetMemHandle(&h, p);
    CUipcMemHandle dh;
    CUresult dr = cuIpcGetMemHandle(&dh, (CUdeviceptr)(uintptr_t)p);
    printf("    cudaIpcGetMemHandle -> %d, cuIpcGetMemHandle -> %d (%s)\n", r, dr, off ? "memshim off" : "pool memory");
    if (off) {
        CHECK(r == cudaSuccess && dr == CUDA_SUCCESS);
    } else {
        CHECK(r == cudaErrorNotSupported);
        CHECK(dr == CUDA_ERROR_NOT_SUPPORTED);
    }
    CHECK(cudaFree(p) == cudaSuccess);
}

TEST_MAIN()
