/*
 * hooks.h: what the three hook files (runtime.c, driver.c, entry.c) share, and nothing else.
 *
 * Everything here is hidden inside libmemshim.so. The exported CUDA symbols are defined in the
 * .c files; this header only gives the other hook files the internal addresses of the driver
 * hooks (for the entry-point substitution), the table of memory memshim passes through (for
 * "other" accounting), and the one helper that decides whether memshim serves memory. Nothing
 * declared here may call a CUDA hook or take a lock that a fork can leave held.
 */
#ifndef MSH_HOOKS_H
#define MSH_HOOKS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MSH_HIDDEN __attribute__((visibility("hidden")))

/* Idempotent: msh_core_init() run with the re-entry flag held. True when memshim serves memory
 * (mode is not off and a driver is usable); false means every hook is exact pass-through. */
MSH_HIDDEN bool msh_hooks_serving(void);

/* A hook whose real driver function is missing: warn once per function (by name) and return
 * CUDA_ERROR_NOT_INITIALIZED (as an int, so this header needs no cuda.h). */
MSH_HIDDEN int msh_hooks_drv_missing(_Atomic int *reported, const char *name);
#define MSH_DRV_MISSING(name)                                                               \
    do {                                                                                    \
        static _Atomic int reported_;                                                       \
        return msh_hooks_drv_missing(&reported_, name);                                     \
    } while (0)

/* ---- pass-through allocations (hooks/driver.c) ----------------------------------------------
 * A fixed-size, lock-free open-addressing table: key -> (size, device, kind). It never allocates
 * and holds no lock, so a fork in the middle of an update cannot leave the child deadlocked.
 * When it is full a new allocation is left out of the accounting (counted in msh_ext_dropped)
 * rather than counted with a free that could never be matched. Two tables: device pointers (cudaMalloc/cuMemAlloc/async pass-through) and
 * VMM handles others create with cuMemCreate. */
enum msh_ext_table { MSH_EXT_TABLE_PTR, MSH_EXT_TABLE_HANDLE };
/* Record `key` and note +size as external memory of `device` (msh_core_note_external). */
MSH_HIDDEN void msh_ext_track(int table, uint64_t key, size_t size, int device, int kind);
/* Remove `key`; when it was tracked, note -size and return true with its size/device/kind. */
MSH_HIDDEN bool msh_ext_untrack(int table, uint64_t key, size_t *size, int *device, int *kind);
extern MSH_HIDDEN _Atomic uint64_t msh_ext_dropped;

/* What cudaMemGetInfo/cuMemGetInfo_v2 report under a limit (docs/interposition.md): when
 * MEMSHIM_LIMIT or a memory fraction (set_per_process_memory_fraction, per_process_memory_fraction
 * in PyTorch's allocator settings) limits `device`'s pool, total = min(limit, real total) and free
 * = the bytes of whole pages one allocation can still get (O(1), from the pool's counters). */
MSH_HIDDEN void msh_hooks_adjust_meminfo(int device, size_t *free_b, size_t *total_b);

/* ---- pool memory beyond allocation (hooks/driver.c; issue 8) --------------------------------- */
/* 1: addr is in a live pool block (base, requested size, device); -1: in a pool's address range
 * but no live block; 0: not pool memory. */
MSH_HIDDEN int msh_hooks_pool_range(uint64_t addr, uint64_t *base, size_t *size, int *device);
/* Legacy IPC asked for pool memory: one warning per process naming the setting; returns
 * CUDA_ERROR_NOT_SUPPORTED (as an int). */
MSH_HIDDEN int msh_hooks_ipc_refused(const char *fn, uint64_t addr, int device);
/* A stream is about to be destroyed: no pool may name it afterwards. */
MSH_HIDDEN void msh_hooks_forget_stream(uint64_t stream);
/* Free a pool block whose last use is complete (cudaFree, cuMemFree); in segment mode give its
 * pages back unless MEMSHIM_EMPTY_CACHE=never. 0 or EINVAL. */
struct msh_pool;
MSH_HIDDEN int msh_hooks_pool_free_host(struct msh_pool *pool, uint64_t addr);

/* ---- captures and peers (hooks/driver.c, issue 15) --------------------------------------------
 * A stream capture is about to begin on `stream` of `device` (shim/capture.c counts it from
 * before the real call, so that no pool synchronizes in between). close: the capture call on
 * `stream` returned; with `force` (its begin failed) it is closed, else only once the driver says
 * the stream no longer captures. */
MSH_HIDDEN void msh_hooks_capture_open(int device, uint64_t stream);
MSH_HIDDEN void msh_hooks_capture_close(uint64_t stream, bool force);
/* The program let device `accessor` reach the memory of device `owner` (cudaDeviceEnablePeerAccess,
 * cuCtxEnablePeerAccess): owner's pools grant it their pages (shim/peers.c). */
MSH_HIDDEN void msh_hooks_peer_enabled(int accessor, int owner);

/* ---- entry-point lookups (hooks/entry.c) ----------------------------------------------------
 * `*pfn` was just returned by a real lookup (cuGetProcAddress[_v2], cudaGetDriverEntryPoint*).
 * When it is the real address of a driver function memshim hooks, replace it by memshim's hook;
 * leave every other pointer untouched. No-op unless memshim serves memory. */
MSH_HIDDEN void msh_entry_substitute(void **pfn);
/* The same for the driver reached without memshim's lookups (dlsym on a program's own handle to
 * libcuda, hooks/dlsym.c): only the capture calls become memshim's hooks, and the lookups become
 * lookups that substitute captures only. Returns whether *pfn was replaced. */
MSH_HIDDEN bool msh_entry_substitute_capture(void **pfn);

/* Internal (non-interposable) addresses of the exported driver hooks in driver.c/entry.c, so the
 * substitution hands out memshim's functions even if another library defines the same names. */
MSH_HIDDEN extern void *const msh_hk_cuMemAlloc_v2, *const msh_hk_cuMemFree_v2,
    *const msh_hk_cuMemGetInfo_v2, *const msh_hk_cuMemAllocAsync, *const msh_hk_cuMemFreeAsync,
    *const msh_hk_cuMemAllocAsync_ptsz, *const msh_hk_cuMemFreeAsync_ptsz,
    *const msh_hk_cuMemCreate, *const msh_hk_cuMemRelease, *const msh_hk_cuMemMap,
    *const msh_hk_cuMemUnmap, *const msh_hk_cuStreamDestroy_v2, *const msh_hk_cuMemGetAddressRange_v2,
    *const msh_hk_cuPointerGetAttribute, *const msh_hk_cuPointerGetAttributes,
    *const msh_hk_cuIpcGetMemHandle, *const msh_hk_cuCtxEnablePeerAccess, *const msh_hk_cuStreamBeginCapture_v2,
    *const msh_hk_cuStreamBeginCapture_v2_ptsz, *const msh_hk_cuStreamEndCapture, *const msh_hk_cuStreamEndCapture_ptsz,
    *const msh_hk_cuStreamBeginCapture, *const msh_hk_cuStreamBeginCapture_ptsz,
    *const msh_hk_cuStreamBeginCaptureToGraph, *const msh_hk_cuStreamBeginCaptureToGraph_ptsz;

#endif
