/*
 * ranges.c: address-range queries on pool memory (issue 8, item 3). Every pool page is its own
 * cuMemMap, so the driver describes one page, whose start may lie inside the neighbouring block;
 * code that registers buffers (NCCL user buffers, CUDA-aware MPI/UCX) needs the block. memshim
 * answers cuMemGetAddressRange_v2, cuPointerGetAttribute(s) (RANGE_START_ADDR, RANGE_SIZE) and
 * cudaPointerGetAttributes from the pool, also for pointers obtained by an entry-point lookup.
 * Run under LD_PRELOAD=libmemshim.so on the driver double.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>

#include "harness.h"

#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#define MiB (1u << 20)

static CUdeviceptr D(void *p) { return (CUdeviceptr)(uintptr_t)p; }

TEST(blocks_not_pages)
{
    void *a = NULL, *b = NULL;
    size_t asz = 3 * MiB + 100, bsz = 2 * MiB;
    REQUIRE(cudaMalloc(&a, asz) == cudaSuccess);
    REQUIRE(cudaMalloc(&b, bsz) == cudaSuccess); /* its first page is a's last */
    CUdeviceptr base = 0;
    size_t size = 0;
    /* an interior address on a's second page, and b's start, whose page begins inside a */
    CHECK(cuMemGetAddressRange(&base, &size, D(a) + 2 * MiB + 5) == CUDA_SUCCESS);
    CHECKF(base == D(a) && size == asz, "a: base %#llx size %zu, want %p %zu", (unsigned long long)base, size, a, asz);
    CHECK(cuMemGetAddressRange(&base, &size, D(b) + 17) == CUDA_SUCCESS);
    CHECKF(base == D(b) && size == bsz, "b: base %#llx size %zu, want %p %zu", (unsigned long long)base, size, b, bsz);
    CUdeviceptr start = 0;
    size_t rsize = 0;
    CHECK(cuPointerGetAttribute(&start, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, D(b) + bsz - 1) == CUDA_SUCCESS);
    CHECK(cuPointerGetAttribute(&rsize, CU_POINTER_ATTRIBUTE_RANGE_SIZE, D(b) + bsz - 1) == CUDA_SUCCESS);
    CHECKF(start == D(b) && rsize == bsz, "attribute range %#llx + %zu", (unsigned long long)start, rsize);
    int ordinal = -1;
    unsigned int type = 0;
    CUpointer_attribute at[4] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_MEMORY_TYPE};
    start = 0;
    rsize = 0;
    void *out[4] = {&start, &rsize, &ordinal, &type};
    CHECK(cuPointerGetAttributes(4, at, out, D(a) + 3 * MiB) == CUDA_SUCCESS);
    CHECK(start == D(a) && rsize == asz && ordinal == 0 && type == CU_MEMORYTYPE_DEVICE);
    struct cudaPointerAttributes pa;
    CHECK(cudaPointerGetAttributes(&pa, (char *)a + MiB) == cudaSuccess);
    CHECK(pa.type == cudaMemoryTypeDevice && pa.device == 0 && pa.devicePointer == (char *)a + MiB);
    /* the same through a driver entry point, as NCCL gets its functions */
    CUresult (*range)(CUdeviceptr *, size_t *, CUdeviceptr) = NULL;
    enum cudaDriverEntryPointQueryResult st;
    REQUIRE(cudaGetDriverEntryPoint("cuMemGetAddressRange", (void **)&range, cudaEnableDefault, &st) ==
                cudaSuccess && range);
    base = 0;
    CHECK(range(&base, &size, D(b) + MiB) == CUDA_SUCCESS && base == D(b) && size == bsz);
    /* freed: no longer an allocation */
    CHECK(cudaFree(b) == cudaSuccess);
    CHECK(cuMemGetAddressRange(&base, &size, D(b) + 17) != CUDA_SUCCESS);
    CHECK(cudaFree(a) == cudaSuccess);
}

TEST_MAIN()
