/*
 * drvlog.h: every CUDA driver function memshim itself calls, counted and timed (issue 24).
 *
 * On a GPU each driver call costs microseconds and a synchronize blocks the calling thread for as
 * long as the GPU is behind; the driver double makes all of them free. So memshim keeps its own
 * ledger: each call it makes through msh_cu goes through MSH_DRV, which adds one to the function's
 * count and the time measured around the call to its total. The counts are exact; the time is
 * read with msh_ticks() (the CPU counter where the kernel's own clock uses it, else
 * CLOCK_MONOTONIC). The pass-through calls memshim forwards for the program (its cuMemAlloc, its
 * cuStreamBeginCapture) are the program's, not in the ledger. The CUDA runtime functions memshim
 * calls on its own behalf (hooks/runtime.c: which device a cudaMalloc is for, binding the
 * runtime's context, and the device synchronize that keeps cudaFree's guarantee) are in it too,
 * under the runtime's names, through MSH_RT: a synchronize made through the runtime blocks the
 * thread as long as one made through the driver.
 *
 * The ledger is process-wide (reports show it in every device's file, "scope": "process"). It is
 * touched only around driver calls: the cached allocation and free paths never reach it.
 *
 * policy/base/ is the ground floor every folder may use (msh.h says what it holds); it includes
 * nothing of memshim's outside policy/base.
 */
#ifndef MSH_DRVLOG_H
#define MSH_DRVLOG_H

#include <stdatomic.h>
#include <stdint.h>

#include "cuda_real.h"
#include "hotclock.h"

/* Every driver function memshim calls on its own behalf. A call through MSH_DRV of a function
 * missing here does not compile. */
#define MSH_DRVLOG_FUNCS(X)                                                                        \
    X(cuMemGetInfo) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease)    \
    X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemGetAllocationGranularity)                   \
    X(cuMemcpyDtoD)                                                                                \
    X(cuEventCreate) X(cuEventRecord) X(cuEventQuery) X(cuEventSynchronize) X(cuEventDestroy)     \
    X(cuStreamWaitEvent) X(cuStreamSynchronize) X(cuStreamGetCtx) X(cuStreamIsCapturing)          \
    X(cuThreadExchangeStreamCaptureMode) X(cuCtxSynchronize) X(cuCtxGetCurrent) X(cuCtxSetCurrent) \
    X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuCtxGetDevice) X(cuDevicePrimaryCtxRetain)           \
    X(cuDevicePrimaryCtxRelease) X(cuDeviceGet) X(cuDeviceGetCount) X(cuDeviceGetName)             \
    X(cuDeviceGetAttribute) X(cuDeviceCanAccessPeer) X(cuDeviceTotalMem) X(cuDriverGetVersion)    \
    X(cuInit) X(cuMemAlloc) X(cuMemFree) X(cuPointerGetAttribute)

/* Every CUDA runtime function memshim calls on its own behalf (hooks/runtime.c), through MSH_RT. */
#define MSH_DRVLOG_RT_FUNCS(X) X(cudaGetDevice) X(cudaSetDevice) X(cudaFree) X(cudaDeviceSynchronize)

enum msh_drvlog_fn {
#define MSH_DL_ENUM_(n) MSH_DL_##n,
    MSH_DRVLOG_FUNCS(MSH_DL_ENUM_) MSH_DRVLOG_RT_FUNCS(MSH_DL_ENUM_)
#undef MSH_DL_ENUM_
    MSH_DL_N
};

/* The driver's names (cuMemCreate, ...), indexed by msh_drvlog_fn. */
extern const char *const msh_drvlog_names[MSH_DL_N];

struct msh_drvlog_cell {
    _Atomic uint64_t count;
    _Atomic uint64_t ticks; /* msh_ticks() units */
};
extern struct msh_drvlog_cell msh_drvlog[MSH_DL_N];

static inline void msh_drvlog_add(enum msh_drvlog_fn f, uint64_t t0)
{
    uint64_t t1 = msh_ticks();
    /* count first, ticks released after it: a reader that sees a call's ticks sees its count too
     * (msh_drvlog_read loads the ticks first), so no figure shows time without a call */
    atomic_fetch_add_explicit(&msh_drvlog[f].count, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&msh_drvlog[f].ticks, t1 > t0 ? t1 - t0 : 0, memory_order_release);
}

/* Call msh_cu.fn(...), counted and timed; evaluates to its CUresult. */
#define MSH_DRV(fn, ...)                                                                           \
    ({                                                                                             \
        uint64_t msh_dl_t0_ = msh_ticks();                                                         \
        CUresult msh_dl_r_ = msh_cu.fn(__VA_ARGS__);                                               \
        msh_drvlog_add(MSH_DL_##fn, msh_dl_t0_);                                                   \
        msh_dl_r_;                                                                                 \
    })

/* Evaluate `call` (a call of the runtime function fn through a pointer the caller resolved),
 * counted and timed under fn's name; evaluates to its result. */
#define MSH_RT(fn, call)                                                                           \
    ({                                                                                             \
        uint64_t msh_rt_t0_ = msh_ticks();                                                         \
        __typeof__(call) msh_rt_r_ = (call);                                                       \
        msh_drvlog_add(MSH_DL_##fn, msh_rt_t0_);                                                   \
        msh_rt_r_;                                                                                 \
    })

/* What the ledger holds now: counts, ticks and seconds per function. */
struct msh_drvlog_snap {
    uint64_t count[MSH_DL_N];
    uint64_t ticks[MSH_DL_N];
    double seconds[MSH_DL_N];
};
void msh_drvlog_read(struct msh_drvlog_snap *s);
/* now - prev (prev NULL: now itself). The seconds come from the ticks' difference at today's tick
 * rate: the rate is refined as the process runs, so two converted totals must not be subtracted
 * (a function not called in between would show a few picoseconds, or less than zero). */
void msh_drvlog_diff(const struct msh_drvlog_snap *now, const struct msh_drvlog_snap *prev,
                     struct msh_drvlog_snap *out);

/* The synchronizes among them, by what they wait for: "device" is the runtime's
 * cudaDeviceSynchronize (a cudaFree of pool memory, hooks/runtime.c), "context" the driver's
 * cuCtxSynchronize on a device's primary context (the pool's own device-wide wait, and cuMemFree
 * of pool memory), "stream" and "event" the driver's stream and event waits. */
enum { MSH_SYNC_DEVICE, MSH_SYNC_CONTEXT, MSH_SYNC_STREAM, MSH_SYNC_EVENT, MSH_SYNC_NKINDS };
extern const char *const msh_sync_kind_names[MSH_SYNC_NKINDS];
/* The ledger function a kind is. */
int msh_sync_kind_fn(int kind);

/* The three largest costs of the ledger in one line ("cuMemCreate 120 calls 1.2 ms, ..."), for
 * MEMSHIM_LOG=info at exit. Writes "" when nothing was called. */
void msh_drvlog_top3(const struct msh_drvlog_snap *s, char *buf, size_t len);

#endif
