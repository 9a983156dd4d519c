/*
 * driver.c: memshim's exported CUDA driver memory hooks (cuMemAlloc_v2, cuMemFree_v2,
 * cuMemGetInfo_v2, cuMemAllocAsync[_ptsz], cuMemFreeAsync[_ptsz], cuMemCreate, cuMemRelease,
 * cuMemMap, cuMemUnmap), the hooks that keep pool memory correct beyond allocation
 * (cuStreamDestroy[_v2], cuMemGetAddressRange_v2, cuPointerGetAttribute[s], cuIpcGetMemHandle)
 * and the accounting of memory that memshim passes through.
 *
 * Programs reach these either through a direct symbol reference bound to the preloaded library
 * or through an entry-point lookup that hooks/entry.c substitutes. Apart from a pointer that
 * memshim's pool handed out, memory is never served here: every call is forwarded to the real
 * driver through msh_cu (a handle-based table, never RTLD_NEXT: libcuda may not even be a direct
 * dependency of the program) and accounted as "other" memory. This file must never make a call
 * that can re-enter a hook with the re-entry flag clear, never allocate, and never take a lock:
 * the pass-through table below is lock-free so that a fork cannot leave it held.
 */
#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <dlfcn.h>

#include "core.h"
#include "cuda_real.h"
#include "drvlog.h"
#include "hooks.h"
#include "memshim.h"
#include "msh.h"
#include "pool.h"

/* Per-thread default stream variants, declared by cuda.h only for CUDA_API_PER_THREAD_DEFAULT_
 * STREAM builds; we export both so that either kind of caller is seen. */
CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);

bool msh_hooks_serving(void)
{
    /* msh_core_init() loads the driver and reads the configuration; whatever CUDA it touches goes
     * through msh_cu, but hold the flag anyway so any hook it might reach passes straight on. */
    int saved = msh_in_hook;
    msh_in_hook = 1;
    bool serving = msh_core_init();
    msh_in_hook = saved;
    return serving;
}

/* ---- pass-through table ---------------------------------------------------------------------
 * Open addressing over a fixed array with a bounded probe window. Keys are stored as key + 2 so
 * that 0 (empty) and 1 (tombstone) never collide with a real pointer or handle. An entry is
 * removed before the real free runs and re-added if that free fails: the driver may hand the
 * same address to another thread the moment the real free returns, and that thread's insert
 * must not be undone by our late removal. */
#define EXT_SLOTS (1u << 16)
#define EXT_PROBE 128u
#define EXT_EMPTY 0u
#define EXT_TOMB 1u
#define EXT_SIZE_MAX (((uint64_t)1 << 48) - 1)

struct ext_slot {
    _Atomic uint64_t key;
    _Atomic uint64_t val; /* size << 16 | (device & 0xff) << 8 | kind */
};
static struct ext_slot ext_tab[2][EXT_SLOTS];
_Atomic uint64_t msh_ext_dropped;

static inline uint32_t ext_hash(uint64_t k)
{
    k ^= k >> 29;
    k *= 0x9e3779b97f4a7c15ull;
    return (uint32_t)(k >> 40);
}

static inline uint64_t ext_pack(size_t size, int device, int kind)
{
    return (uint64_t)size << 16 | (uint64_t)(device & 0xff) << 8 | (uint64_t)(kind & 0xff);
}

static inline void ext_unpack(uint64_t v, size_t *size, int *device, int *kind)
{
    *size = (size_t)(v >> 16);
    int d = (int)((v >> 8) & 0xff);
    *device = d == 0xff ? -1 : d;
    *kind = (int)(v & 0xff);
}

static void ext_note(int device, int kind, int64_t delta)
{
    if (device >= 0 && device < MSH_MAX_DEVICES && kind >= 0 && kind < MSH_EXT_NKINDS)
        msh_core_note_external(device, kind, delta);
}

void msh_ext_track(int table, uint64_t key, size_t size, int device, int kind)
{
    if (key >= UINT64_MAX - 2 || size > EXT_SIZE_MAX || (table != 0 && table != 1)) {
        atomic_fetch_add_explicit(&msh_ext_dropped, 1, memory_order_relaxed);
        return;
    }
    struct ext_slot *tab = ext_tab[table];
    uint64_t k = key + 2, val = ext_pack(size, device, kind);
    uint32_t h = ext_hash(key);

    /* A stale entry for this key (its free went through a path we do not see) is replaced, so
     * "other" memory cannot grow without bound. */
    for (uint32_t i = 0; i < EXT_PROBE; i++) {
        struct ext_slot *s = &tab[(h + i) & (EXT_SLOTS - 1)];
        uint64_t cur = atomic_load_explicit(&s->key, memory_order_acquire);
        if (cur == EXT_EMPTY) break;
        if (cur == k) {
            size_t osize; int odev, okind;
            ext_unpack(atomic_exchange_explicit(&s->val, val, memory_order_acq_rel), &osize,
                       &odev, &okind);
            ext_note(odev, okind, -(int64_t)osize);
            ext_note(device, kind, (int64_t)size);
            return;
        }
    }
    for (uint32_t i = 0; i < EXT_PROBE;) {
        struct ext_slot *s = &tab[(h + i) & (EXT_SLOTS - 1)];
        uint64_t cur = atomic_load_explicit(&s->key, memory_order_acquire);
        if (cur != EXT_EMPTY && cur != EXT_TOMB) { i++; continue; }
        /* Claim the slot, then publish the value; the matching untrack runs after the caller
         * got the pointer back, so it cannot observe the slot between the two stores. */
        if (atomic_compare_exchange_weak_explicit(&s->key, &cur, k, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            atomic_store_explicit(&s->val, val, memory_order_release);
            ext_note(device, kind, (int64_t)size);
            return;
        }
        /* lost a race for this slot: look at it again */
    }
    /* Full: leave it out of the accounting altogether, since its free could not be matched and
     * "other" would drift upward forever. */
    atomic_fetch_add_explicit(&msh_ext_dropped, 1, memory_order_relaxed);
}

bool msh_ext_untrack(int table, uint64_t key, size_t *size, int *device, int *kind)
{
    if (key >= UINT64_MAX - 2 || (table != 0 && table != 1)) return false;
    struct ext_slot *tab = ext_tab[table];
    uint64_t k = key + 2;
    uint32_t h = ext_hash(key);
    for (uint32_t i = 0; i < EXT_PROBE; i++) {
        struct ext_slot *s = &tab[(h + i) & (EXT_SLOTS - 1)];
        uint64_t cur = atomic_load_explicit(&s->key, memory_order_acquire);
        if (cur == EXT_EMPTY) return false;
        if (cur != k) continue;
        uint64_t v = atomic_load_explicit(&s->val, memory_order_acquire);
        if (!atomic_compare_exchange_strong_explicit(&s->key, &cur, (uint64_t)EXT_TOMB,
                                                     memory_order_acq_rel, memory_order_acquire))
            return false; /* another thread freed the same pointer first */
        ext_unpack(v, size, device, kind);
        ext_note(*device, *kind, -(int64_t)*size);
        return true;
    }
    return false;
}

/* ---- helpers ------------------------------------------------------------------------------- */

/* The real driver function `field` of msh_cu, loading the table on first use. Loading calls the
 * real cuInit; a program that reaches a driver memory hook has already done so. */
#define REAL_DRV(field) (msh_cuda_load(), msh_cu.field)

int msh_hooks_drv_missing(_Atomic int *reported, const char *name)
{
    if (!atomic_exchange(reported, 1))
        msh_warn("the CUDA driver does not provide %s; returning CUDA_ERROR_NOT_INITIALIZED", name);
    return CUDA_ERROR_NOT_INITIALIZED;
}

/* Device of the calling thread's current context, or -1 (then nothing is accounted). */
static int current_device(void)
{
    CUdevice d;
    if (msh_cu.cuCtxGetDevice && MSH_DRV(cuCtxGetDevice, &d) == CUDA_SUCCESS) return (int)d;
    return -1;
}

/* _ptsz driver entry points are not in msh_cu; resolve them from the same handle once. */
static CUresult (*real_cuMemAllocAsync_ptsz)(CUdeviceptr *, size_t, CUstream);
static CUresult (*real_cuMemFreeAsync_ptsz)(CUdeviceptr, CUstream);
static pthread_once_t ptsz_once = PTHREAD_ONCE_INIT;
static void resolve_ptsz(void)
{
    msh_cuda_load(); /* fills msh_cu.handle even when cuInit fails */
    if (!msh_cu.handle) return;
    MSH_ABI_ASSERT(real_cuMemAllocAsync_ptsz, PFN_cuMemAllocAsync_v11020_ptsz, "cuMemAllocAsync_ptsz");
    MSH_ABI_ASSERT(real_cuMemFreeAsync_ptsz, PFN_cuMemFreeAsync_v11020_ptsz, "cuMemFreeAsync_ptsz");
    *(void **)&real_cuMemAllocAsync_ptsz = dlsym(msh_cu.handle, "cuMemAllocAsync_ptsz");
    *(void **)&real_cuMemFreeAsync_ptsz = dlsym(msh_cu.handle, "cuMemFreeAsync_ptsz");
}

/* Free memory under MEMSHIM_LIMIT is what one cudaMalloc of that size can get, in whole pages:
 * the pages the pool may still create (below the limit and within the driver's free memory)
 * plus the cached pages it can reclaim or give back and recreate. Pages live blocks touch are
 * not free even in part: the small and large areas never share a page, and a block placed at a
 * free extent's end shares at most the page its live neighbour already touches, so a request of
 * this many bytes never needs more new pages than counted. O(1): counters only. */
void msh_hooks_adjust_meminfo(int device, size_t *free_b, size_t *total_b)
{
    if (device < 0) return;
    /* the limit is only enforced where a pool serves (msh_core_pool_get never creates one) */
    struct msh_pool *pool = msh_core_pool_get(device);
    if (!pool) return;
    struct msh_pool_counters c;
    msh_pool_counters(pool, &c);
    /* MEMSHIM_LIMIT, or the smaller limit the pool enforces: set_per_process_memory_fraction, or
     * per_process_memory_fraction in PyTorch's allocator settings (shim/torch.c). A job that sizes
     * its buffers from free memory must see the cap it runs under, not the card. */
    uint64_t limit = msh_cfg.limit_bytes;
    if (!limit && msh_cfg.limit_fraction > 0)
        limit = (uint64_t)(msh_cfg.limit_fraction * (double)*total_b);
    if (limit >= *total_b) limit = 0; /* at or above the device: no limit (issue 31), the driver's figures */
    if (c.limit && (!limit || c.limit < limit)) limit = c.limit;
    if (!limit) return;
    size_t total = limit < *total_b ? (size_t)limit : *total_b;
    size_t cap_pages = (c.limit ? c.limit : total) / c.gran;
    size_t creatable = cap_pages > c.handles ? cap_pages - c.handles : 0;
    size_t driver_pages = *free_b / c.gran;
    if (creatable > driver_pages) creatable = driver_pages;
    size_t reusable = c.defrag || c.release_on_oom ? c.cached_pages : 0;
    size_t pages = creatable + reusable;
    *total_b = total;
    *free_b = pages > total / c.gran ? total / c.gran * c.gran : pages * c.gran;
}

/* ---- pool memory seen by pointer queries (issue 8, item 3) -------------------------------------
 * Each cuMemMap is its own range to the driver, so for pool memory cuMemGetAddressRange and the
 * range attributes would describe one page, whose start may lie inside a neighbour. memshim
 * answers them from the pool: the live block's start and requested size. */

/* 1: addr is in a live pool block (*base, *size, *device); -1: in a pool's address range but in
 * no live block; 0: not pool memory. */
static int pool_range(uint64_t addr, uint64_t *base, size_t *size, int *device)
{
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = msh_core_pool_get(d);
        if (!p) continue;
        if (msh_pool_block_containing(p, addr, base, size) == 0) {
            if (device) *device = d;
            return 1;
        }
        if (msh_pool_covers(p, addr)) return -1;
    }
    return 0;
}

int msh_hooks_pool_range(uint64_t addr, uint64_t *base, size_t *size, int *device)
{
    return pool_range(addr, base, size, device);
}

/* Legacy IPC (cudaIpcGetMemHandle) cannot share VMM memory; the driver's error names nothing.
 * One line per process says what to do: only MEMSHIM_MODE=off keeps such jobs' memory out of
 * the pool (in segment mode PyTorch's segments are pool memory too). */
int msh_hooks_ipc_refused(const char *fn, uint64_t addr, int device)
{
    static _Atomic int said;
    if (!atomic_exchange(&said, 1))
        msh_warn("%s(%p): this memory comes from memshim's pool on device %d (CUDA virtual memory), "
                 "which legacy CUDA IPC cannot share; run jobs that share CUDA memory between "
                 "processes with MEMSHIM_MODE=off", fn, (void *)(uintptr_t)addr, device);
    return CUDA_ERROR_NOT_SUPPORTED;
}

void msh_hooks_forget_stream(uint64_t stream)
{
    for (int d = 0; d < MSH_MAX_DEVICES; d++) {
        struct msh_pool *p = msh_core_pool_get(d);
        if (p) msh_pool_forget_stream(p, stream);
    }
}

/* cudaFree / cuMemFree of a pool block in segment mode is PyTorch giving a segment back
 * (empty_cache, its OOM retry, its GC threshold; DESIGN.md 3): the block's pages that no live
 * block still touches go back to the driver at once, unless MEMSHIM_EMPTY_CACHE=never keeps them
 * cached. In tensor mode PyTorch frees through memshim_free; a cudaFree there comes from another
 * library, and the pool's page cache serves memshim's own reuse. */
int msh_hooks_pool_free_host(struct msh_pool *pool, uint64_t addr)
{
    if (msh_cfg.empty_cache == MSH_EC_NEVER || msh_core_mode() != MSH_MODE_SEGMENT)
        return msh_pool_free(pool, addr, MSH_STREAM_COMPLETED);
    return msh_pool_free_release(pool, addr, MSH_STREAM_COMPLETED, NULL);
}

/* Free a pool block the way cuMemFree would: after the work queued on the device that owns it
 * (not the caller's current context: the block may belong to another GPU). */
static CUresult pool_free_synced(struct msh_pool *pool, int dev, CUdeviceptr p, uint64_t stream)
{
    if (stream == MSH_STREAM_COMPLETED && msh_core_sync_device(dev) != 0)
        return CUDA_ERROR_UNKNOWN; /* the block may still be in use: keep it */
    int rc = stream == MSH_STREAM_COMPLETED ? msh_hooks_pool_free_host(pool, (uint64_t)p)
                                            : msh_pool_free(pool, (uint64_t)p, stream);
    return rc == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ---- hooks ---------------------------------------------------------------------------------
 * Stream-ordered allocation (cuMemAllocAsync) stays with the driver: its pools have semantics
 * memshim does not emulate yet (cross-stream reuse rules, pool attributes, IPC export, graph
 * capture of alloc/free nodes). Serving it from our pool is future work; until then it is
 * passed through and shows up as "other". */

static CUresult hk_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    CUresult (*real)(CUdeviceptr *, size_t) = REAL_DRV(cuMemAlloc);
    if (!real) MSH_DRV_MISSING("cuMemAlloc_v2");
    if (msh_in_hook || !msh_hooks_serving()) return real(dptr, bytesize);
    msh_in_hook = 1;
    CUresult r = real(dptr, bytesize);
    if (r == CUDA_SUCCESS && dptr && *dptr)
        msh_ext_track(MSH_EXT_TABLE_PTR, (uint64_t)*dptr, bytesize, current_device(),
                      MSH_EXT_MALLOC);
    msh_core_count(bytesize);
    msh_in_hook = 0;
    return r;
}

static CUresult hk_cuMemFree_v2(CUdeviceptr dptr)
{
    CUresult (*real)(CUdeviceptr) = REAL_DRV(cuMemFree);
    if (!real) MSH_DRV_MISSING("cuMemFree_v2");
    if (msh_in_hook || !dptr || !msh_hooks_serving()) return real(dptr);
    msh_in_hook = 1;
    CUresult r;
    int dev;
    struct msh_pool *pool = msh_core_pool_owning((uint64_t)dptr, &dev);
    if (pool) {
        /* A program mixing APIs frees a cudaMalloc pointer with cuMemFree. */
        r = pool_free_synced(pool, dev, dptr, MSH_STREAM_COMPLETED);
    } else {
        size_t size; int d, kind;
        bool tracked = msh_ext_untrack(MSH_EXT_TABLE_PTR, (uint64_t)dptr, &size, &d, &kind);
        r = real(dptr);
        if (r != CUDA_SUCCESS && tracked) msh_ext_track(MSH_EXT_TABLE_PTR, (uint64_t)dptr, size, d, kind);
    }
    msh_in_hook = 0;
    return r;
}

static CUresult hk_cuMemGetInfo_v2(size_t *free_b, size_t *total_b)
{
    CUresult (*real)(size_t *, size_t *) = REAL_DRV(cuMemGetInfo);
    if (!real) MSH_DRV_MISSING("cuMemGetInfo_v2");
    if (msh_in_hook || !msh_hooks_serving()) return real(free_b, total_b);
    msh_in_hook = 1;
    CUresult r = real(free_b, total_b); /* the driver validates the arguments as it would */
    if (r == CUDA_SUCCESS && free_b && total_b)
        msh_hooks_adjust_meminfo(current_device(), free_b, total_b);
    msh_in_hook = 0;
    return r;
}

static CUresult async_alloc(CUresult (*real)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr,
                            size_t bytesize, CUstream stream)
{
    if (msh_in_hook || !msh_hooks_serving()) return real(dptr, bytesize, stream);
    msh_in_hook = 1;
    CUresult r = real(dptr, bytesize, stream);
    if (r == CUDA_SUCCESS && dptr && *dptr)
        msh_ext_track(MSH_EXT_TABLE_PTR, (uint64_t)*dptr, bytesize, current_device(),
                      MSH_EXT_ASYNC);
    msh_core_count(bytesize);
    msh_in_hook = 0;
    return r;
}

static CUresult async_free(CUresult (*real)(CUdeviceptr, CUstream), CUdeviceptr dptr,
                           CUstream stream, CUstream default_stream)
{
    if (msh_in_hook || !dptr || !msh_hooks_serving()) return real(dptr, stream);
    msh_in_hook = 1;
    CUresult r;
    int dev;
    struct msh_pool *pool = msh_core_pool_owning((uint64_t)dptr, &dev);
    if (pool) {
        /* The pool takes stream-ordered frees natively: reuse waits for `stream`. Stream 0 is
         * the legacy default stream, except for _ptsz callers where it is the thread's own. */
        CUstream s = stream ? stream : default_stream;
        r = pool_free_synced(pool, dev, dptr, (uint64_t)(uintptr_t)s);
    } else {
        size_t size; int d, kind;
        bool tracked = msh_ext_untrack(MSH_EXT_TABLE_PTR, (uint64_t)dptr, &size, &d, &kind);
        r = real(dptr, stream);
        if (r != CUDA_SUCCESS && tracked) msh_ext_track(MSH_EXT_TABLE_PTR, (uint64_t)dptr, size, d, kind);
    }
    msh_in_hook = 0;
    return r;
}

static CUresult hk_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    CUresult (*real)(CUdeviceptr *, size_t, CUstream) = REAL_DRV(cuMemAllocAsync);
    if (!real) MSH_DRV_MISSING("cuMemAllocAsync");
    return async_alloc(real, dptr, bytesize, stream);
}

static CUresult hk_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    CUresult (*real)(CUdeviceptr, CUstream) = REAL_DRV(cuMemFreeAsync);
    if (!real) MSH_DRV_MISSING("cuMemFreeAsync");
    return async_free(real, dptr, stream, (CUstream)0);
}

static CUresult hk_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    pthread_once(&ptsz_once, resolve_ptsz);
    if (!real_cuMemAllocAsync_ptsz) MSH_DRV_MISSING("cuMemAllocAsync_ptsz");
    return async_alloc(real_cuMemAllocAsync_ptsz, dptr, bytesize, stream);
}

static CUresult hk_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    pthread_once(&ptsz_once, resolve_ptsz);
    if (!real_cuMemFreeAsync_ptsz) MSH_DRV_MISSING("cuMemFreeAsync_ptsz");
    return async_free(real_cuMemFreeAsync_ptsz, dptr, stream, CU_STREAM_PER_THREAD);
}

/* VMM calls made by others (PyTorch expandable segments, NCCL buffers, when they obtained these
 * through a hooked lookup or a direct reference): forwarded unchanged; the physical bytes of
 * handles they create are "other" memory of the handle's device until released. memshim's own
 * pool calls msh_cu directly and never comes through here. */
static CUresult hk_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                               const CUmemAllocationProp *prop, unsigned long long flags)
{
    CUresult (*real)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long) = REAL_DRV(cuMemCreate);
    if (!real) MSH_DRV_MISSING("cuMemCreate");
    if (msh_in_hook || !msh_hooks_serving()) return real(handle, size, prop, flags);
    msh_in_hook = 1;
    CUresult r = real(handle, size, prop, flags);
    if (r == CUDA_SUCCESS && handle) {
        int dev = prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : -1;
        msh_ext_track(MSH_EXT_TABLE_HANDLE, (uint64_t)*handle, size, dev, MSH_EXT_VMM);
    }
    msh_core_count(size);
    msh_in_hook = 0;
    return r;
}

static CUresult hk_cuMemRelease(CUmemGenericAllocationHandle handle)
{
    CUresult (*real)(CUmemGenericAllocationHandle) = REAL_DRV(cuMemRelease);
    if (!real) MSH_DRV_MISSING("cuMemRelease");
    if (msh_in_hook || !msh_hooks_serving()) return real(handle);
    msh_in_hook = 1;
    size_t size; int d, kind;
    bool tracked = msh_ext_untrack(MSH_EXT_TABLE_HANDLE, (uint64_t)handle, &size, &d, &kind);
    CUresult r = real(handle);
    if (r != CUDA_SUCCESS && tracked) msh_ext_track(MSH_EXT_TABLE_HANDLE, (uint64_t)handle, size, d, kind);
    msh_in_hook = 0;
    return r;
}

static CUresult hk_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                            CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    CUresult (*real)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                     unsigned long long) = REAL_DRV(cuMemMap);
    if (!real) MSH_DRV_MISSING("cuMemMap");
    return real(ptr, size, offset, handle, flags);
}

static CUresult hk_cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    CUresult (*real)(CUdeviceptr, size_t) = REAL_DRV(cuMemUnmap);
    if (!real) MSH_DRV_MISSING("cuMemUnmap");
    return real(ptr, size);
}

/* ---- streams that go away, pointer queries, legacy IPC (issue 8) ----------------------------- */

/* Before the driver forgets a stream, the pools must (msh_pool_forget_stream). */
static CUresult hk_cuStreamDestroy_v2(CUstream stream)
{
    CUresult (*real)(CUstream) = REAL_DRV(cuStreamDestroy);
    if (!real) MSH_DRV_MISSING("cuStreamDestroy_v2");
    if (msh_in_hook || !msh_hooks_serving()) return real(stream);
    msh_in_hook = 1;
    if (stream && stream != CU_STREAM_LEGACY && stream != CU_STREAM_PER_THREAD)
        msh_hooks_forget_stream((uint64_t)(uintptr_t)stream);
    CUresult r = real(stream);
    msh_in_hook = 0;
    return r;
}

static CUresult hk_cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    CUresult (*real)(CUdeviceptr *, size_t *, CUdeviceptr) = REAL_DRV(cuMemGetAddressRange);
    if (!real) MSH_DRV_MISSING("cuMemGetAddressRange_v2");
    if (msh_in_hook || !msh_hooks_serving()) return real(pbase, psize, dptr);
    msh_in_hook = 1;
    uint64_t base = 0;
    size_t size = 0;
    int in = pool_range((uint64_t)dptr, &base, &size, NULL);
    CUresult r;
    if (in > 0) {
        if (pbase) *pbase = (CUdeviceptr)base;
        if (psize) *psize = size;
        r = CUDA_SUCCESS;
    } else {
        r = in < 0 ? CUDA_ERROR_NOT_FOUND : real(pbase, psize, dptr); /* pool VA, no allocation */
    }
    msh_in_hook = 0;
    return r;
}

static bool range_attr(CUpointer_attribute a)
{
    return a == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR || a == CU_POINTER_ATTRIBUTE_RANGE_SIZE;
}

static CUresult hk_cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    CUresult (*real)(void *, CUpointer_attribute, CUdeviceptr) = REAL_DRV(cuPointerGetAttribute);
    if (!real) MSH_DRV_MISSING("cuPointerGetAttribute");
    if (msh_in_hook || !range_attr(attribute) || !data || !msh_hooks_serving()) return real(data, attribute, ptr);
    msh_in_hook = 1;
    uint64_t base = 0;
    size_t size = 0;
    int in = pool_range((uint64_t)ptr, &base, &size, NULL);
    CUresult r;
    if (in > 0) {
        if (attribute == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) *(CUdeviceptr *)data = (CUdeviceptr)base;
        else *(size_t *)data = size;
        r = CUDA_SUCCESS;
    } else {
        r = in < 0 ? CUDA_ERROR_INVALID_VALUE : real(data, attribute, ptr);
    }
    msh_in_hook = 0;
    return r;
}

/* The driver answers everything; the range entries are then replaced for pool memory. */
static CUresult hk_cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attributes, void **data,
                                          CUdeviceptr ptr)
{
    CUresult (*real)(unsigned int, CUpointer_attribute *, void **, CUdeviceptr) = REAL_DRV(cuPointerGetAttributes);
    if (!real) MSH_DRV_MISSING("cuPointerGetAttributes");
    if (msh_in_hook || !msh_hooks_serving()) return real(n, attributes, data, ptr);
    msh_in_hook = 1;
    CUresult r = real(n, attributes, data, ptr);
    uint64_t base = 0;
    size_t size = 0;
    int in = r == CUDA_SUCCESS && attributes && data ? pool_range((uint64_t)ptr, &base, &size, NULL) : 0;
    for (unsigned i = 0; in && i < n; i++) {
        if (!data[i] || !range_attr(attributes[i])) continue;
        if (attributes[i] == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) *(CUdeviceptr *)data[i] = in > 0 ? base : 0;
        else *(size_t *)data[i] = in > 0 ? size : 0;
    }
    msh_in_hook = 0;
    return r;
}

static CUresult hk_cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    CUresult (*real)(CUipcMemHandle *, CUdeviceptr) = REAL_DRV(cuIpcGetMemHandle);
    if (!real) MSH_DRV_MISSING("cuIpcGetMemHandle");
    if (msh_in_hook || !msh_hooks_serving()) return real(pHandle, dptr);
    msh_in_hook = 1;
    uint64_t base = 0;
    size_t size = 0;
    int dev = -1;
    int in = pool_range((uint64_t)dptr, &base, &size, &dev);
    CUresult r = in ? (CUresult)msh_hooks_ipc_refused("cuIpcGetMemHandle", (uint64_t)dptr, dev)
                    : real(pHandle, dptr);
    msh_in_hook = 0;
    return r;
}

/* ---- captures and peers (issue 15; hooks.h) ------------------------------------------------- */

#include "capture.h"
#include "peers.h"

void msh_hooks_capture_open(int device, uint64_t stream)
{
    msh_capture_open(device < 0 ? 0 : device, MSH_CAPTURE_STREAM, stream);
}

void msh_hooks_capture_close(uint64_t stream, bool force)
{
    if (!force && msh_cu.cuStreamIsCapturing) {
        CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
        /* an end on a stream that is not the capture's origin leaves the capture going */
        if (MSH_DRV(cuStreamIsCapturing, (CUstream)(uintptr_t)stream, &st) == CUDA_SUCCESS &&
            st == CU_STREAM_CAPTURE_STATUS_ACTIVE)
            return;
    }
    msh_capture_close(MSH_CAPTURE_STREAM, stream);
}

void msh_hooks_peer_enabled(int accessor, int owner)
{
    msh_peers_enabled(accessor, owner);
}

static int drv_current_device(void)
{
    CUdevice d = -1;
    if (!msh_cu.cuCtxGetDevice || MSH_DRV(cuCtxGetDevice, &d) != CUDA_SUCCESS) return -1;
    return (int)d;
}

/* cuCtxEnablePeerAccess: the current context's device may reach peerContext's memory. */
static CUresult hk_cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    CUresult (*real)(CUcontext, unsigned int) = REAL_DRV(cuCtxEnablePeerAccess);
    if (!real) MSH_DRV_MISSING("cuCtxEnablePeerAccess");
    if (msh_in_hook || !msh_hooks_serving()) return real(peerContext, Flags);
    msh_in_hook = 1;
    CUresult r = real(peerContext, Flags);
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
        int accessor = drv_current_device(), owner = -1;
        CUcontext prev = NULL;
        if (msh_cu.cuCtxPushCurrent && MSH_DRV(cuCtxPushCurrent, peerContext) == CUDA_SUCCESS) {
            owner = drv_current_device();
            MSH_DRV(cuCtxPopCurrent, &prev);
        }
        if (accessor >= 0 && owner >= 0) msh_hooks_peer_enabled(accessor, owner);
    }
    msh_in_hook = 0;
    return r;
}

/* Every begin hook, whatever its form (the mode argument or not, ToGraph, per-thread): the capture
 * is counted open before the real call, so that no pool synchronizes or unmaps between the driver's
 * begin and memshim's bookkeeping, and closed again when the begin fails. begin_open returns
 * whether this hook keeps the books (false: re-entered from memshim, or not serving: straight
 * through). `s` is the stream as the pools will see it (a per-thread form's NULL is
 * CU_STREAM_PER_THREAD). */
static bool begin_open(CUstream s)
{
    if (msh_in_hook || !msh_hooks_serving()) return false;
    msh_in_hook = 1;
    msh_hooks_capture_open(drv_current_device(), (uint64_t)(uintptr_t)s);
    return true;
}

static CUresult begin_done(CUstream s, CUresult r)
{
    if (r != CUDA_SUCCESS) msh_hooks_capture_close((uint64_t)(uintptr_t)s, true);
    msh_in_hook = 0;
    return r;
}

static CUresult drv_end_capture(CUresult (*real)(CUstream, CUgraph *), CUstream s, CUgraph *g)
{
    if (msh_in_hook || !msh_hooks_serving()) return real(s, g);
    msh_in_hook = 1;
    CUresult r = real(s, g);
    msh_hooks_capture_close((uint64_t)(uintptr_t)s, false);
    msh_in_hook = 0;
    return r;
}

#define PT_STREAM(s) ((s) ? (s) : CU_STREAM_PER_THREAD)

static CUresult hk_cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode)
{
    CUresult (*real)(CUstream, CUstreamCaptureMode) = REAL_DRV(cuStreamBeginCapture);
    if (!real) MSH_DRV_MISSING("cuStreamBeginCapture_v2");
    return begin_open(s) ? begin_done(s, real(s, mode)) : real(s, mode);
}

static CUresult hk_cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode)
{
    CUresult (*real)(CUstream, CUstreamCaptureMode) = REAL_DRV(cuStreamBeginCapture_ptsz);
    if (!real) MSH_DRV_MISSING("cuStreamBeginCapture_v2_ptsz");
    s = PT_STREAM(s);
    return begin_open(s) ? begin_done(s, real(s, mode)) : real(s, mode);
}

/* CUDA 10.0's begin (no mode): what programs built then reference, and what a lookup of
 * "cuStreamBeginCapture" below version 10010 returns. */
static CUresult hk_cuStreamBeginCapture(CUstream s)
{
    CUresult (*real)(CUstream) = REAL_DRV(cuStreamBeginCapture_v1);
    if (!real) MSH_DRV_MISSING("cuStreamBeginCapture");
    return begin_open(s) ? begin_done(s, real(s)) : real(s);
}

static CUresult hk_cuStreamBeginCapture_ptsz(CUstream s)
{
    CUresult (*real)(CUstream) = REAL_DRV(cuStreamBeginCapture_v1_ptsz);
    if (!real) MSH_DRV_MISSING("cuStreamBeginCapture_ptsz");
    s = PT_STREAM(s);
    return begin_open(s) ? begin_done(s, real(s)) : real(s);
}

#if MSH_HAVE_TO_GRAPH
/* CUDA 12.3: a capture that appends to an existing graph (conditional nodes' bodies, graphs built
 * in pieces); the stream captures exactly as with cuStreamBeginCapture. */
static CUresult hk_cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps,
                                               const CUgraphEdgeData *data, size_t n, CUstreamCaptureMode mode)
{
    CUresult (*real)(CUstream, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t, CUstreamCaptureMode) =
        REAL_DRV(cuStreamBeginCaptureToGraph);
    if (!real) MSH_DRV_MISSING("cuStreamBeginCaptureToGraph");
    return begin_open(s) ? begin_done(s, real(s, g, deps, data, n, mode)) : real(s, g, deps, data, n, mode);
}

static CUresult hk_cuStreamBeginCaptureToGraph_ptsz(CUstream s, CUgraph g, const CUgraphNode *deps,
                                                    const CUgraphEdgeData *data, size_t n, CUstreamCaptureMode mode)
{
    CUresult (*real)(CUstream, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t, CUstreamCaptureMode) =
        REAL_DRV(cuStreamBeginCaptureToGraph_ptsz);
    if (!real) MSH_DRV_MISSING("cuStreamBeginCaptureToGraph_ptsz");
    s = PT_STREAM(s);
    return begin_open(s) ? begin_done(s, real(s, g, deps, data, n, mode)) : real(s, g, deps, data, n, mode);
}
#endif

static CUresult hk_cuStreamEndCapture(CUstream s, CUgraph *g)
{
    CUresult (*real)(CUstream, CUgraph *) = REAL_DRV(cuStreamEndCapture);
    if (!real) MSH_DRV_MISSING("cuStreamEndCapture");
    return drv_end_capture(real, s, g);
}

static CUresult hk_cuStreamEndCapture_ptsz(CUstream s, CUgraph *g)
{
    CUresult (*real)(CUstream, CUgraph *) = REAL_DRV(cuStreamEndCapture_ptsz);
    if (!real) MSH_DRV_MISSING("cuStreamEndCapture_ptsz");
    return drv_end_capture(real, PT_STREAM(s), g);
}

/* The exported names are aliases of the static functions above: memshim's own references (the
 * substitution table) bind to these bodies even if another object defines the same names. */
#define EXPORT_ALIAS(name, ret, args) MSH_EXPORT ret name args __attribute__((alias("hk_" #name)));
EXPORT_ALIAS(cuMemAlloc_v2, CUresult, (CUdeviceptr *, size_t))
EXPORT_ALIAS(cuMemFree_v2, CUresult, (CUdeviceptr))
EXPORT_ALIAS(cuMemGetInfo_v2, CUresult, (size_t *, size_t *))
EXPORT_ALIAS(cuMemAllocAsync, CUresult, (CUdeviceptr *, size_t, CUstream))
EXPORT_ALIAS(cuMemFreeAsync, CUresult, (CUdeviceptr, CUstream))
EXPORT_ALIAS(cuMemAllocAsync_ptsz, CUresult, (CUdeviceptr *, size_t, CUstream))
EXPORT_ALIAS(cuMemFreeAsync_ptsz, CUresult, (CUdeviceptr, CUstream))
EXPORT_ALIAS(cuMemCreate, CUresult,
             (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))
EXPORT_ALIAS(cuMemRelease, CUresult, (CUmemGenericAllocationHandle))
EXPORT_ALIAS(cuMemMap, CUresult,
             (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))
EXPORT_ALIAS(cuMemUnmap, CUresult, (CUdeviceptr, size_t))
EXPORT_ALIAS(cuStreamDestroy_v2, CUresult, (CUstream))
EXPORT_ALIAS(cuMemGetAddressRange_v2, CUresult, (CUdeviceptr *, size_t *, CUdeviceptr))
EXPORT_ALIAS(cuPointerGetAttribute, CUresult, (void *, CUpointer_attribute, CUdeviceptr))
EXPORT_ALIAS(cuPointerGetAttributes, CUresult, (unsigned int, CUpointer_attribute *, void **, CUdeviceptr))
EXPORT_ALIAS(cuIpcGetMemHandle, CUresult, (CUipcMemHandle *, CUdeviceptr))
EXPORT_ALIAS(cuCtxEnablePeerAccess, CUresult, (CUcontext, unsigned int))
EXPORT_ALIAS(cuStreamBeginCapture_v2, CUresult, (CUstream, CUstreamCaptureMode))
EXPORT_ALIAS(cuStreamBeginCapture_v2_ptsz, CUresult, (CUstream, CUstreamCaptureMode))
EXPORT_ALIAS(cuStreamEndCapture, CUresult, (CUstream, CUgraph *))
EXPORT_ALIAS(cuStreamEndCapture_ptsz, CUresult, (CUstream, CUgraph *))
EXPORT_ALIAS(cuStreamBeginCapture_ptsz, CUresult, (CUstream))
#if MSH_HAVE_TO_GRAPH
EXPORT_ALIAS(cuStreamBeginCaptureToGraph, CUresult,
             (CUstream, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t, CUstreamCaptureMode))
EXPORT_ALIAS(cuStreamBeginCaptureToGraph_ptsz, CUresult,
             (CUstream, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t, CUstreamCaptureMode))
#endif
/* cuda.h maps cuStreamBeginCapture to the _v2 ABI; the symbol itself is CUDA 10.0's. */
#undef cuStreamBeginCapture
MSH_EXPORT CUresult cuStreamBeginCapture(CUstream) __attribute__((alias("hk_cuStreamBeginCapture")));
/* The v1 cuStreamDestroy has the same signature (the 32-bit ABI change did not touch it). */
#undef cuStreamDestroy
MSH_EXPORT CUresult cuStreamDestroy(CUstream) __attribute__((alias("hk_cuStreamDestroy_v2")));

/* The hooks' internal addresses for hooks/entry.c, each checked against cudaTypedefs.h's type of the
 * driver ABI it stands in for (the one its exported name is). */
#define HOOK_ADDR(name, pfn)                                                                    \
    MSH_ABI_ASSERT(&hk_##name, pfn, "hk_" #name);                                               \
    void *const msh_hk_##name = (void *)hk_##name;
HOOK_ADDR(cuMemAlloc_v2, PFN_cuMemAlloc_v3020)
HOOK_ADDR(cuMemFree_v2, PFN_cuMemFree_v3020)
HOOK_ADDR(cuMemGetInfo_v2, PFN_cuMemGetInfo_v3020)
HOOK_ADDR(cuMemAllocAsync, PFN_cuMemAllocAsync_v11020)
HOOK_ADDR(cuMemFreeAsync, PFN_cuMemFreeAsync_v11020)
HOOK_ADDR(cuMemAllocAsync_ptsz, PFN_cuMemAllocAsync_v11020_ptsz)
HOOK_ADDR(cuMemFreeAsync_ptsz, PFN_cuMemFreeAsync_v11020_ptsz)
HOOK_ADDR(cuMemCreate, PFN_cuMemCreate_v10020)
HOOK_ADDR(cuMemRelease, PFN_cuMemRelease_v10020)
HOOK_ADDR(cuMemMap, PFN_cuMemMap_v10020)
HOOK_ADDR(cuMemUnmap, PFN_cuMemUnmap_v10020)
HOOK_ADDR(cuStreamDestroy_v2, PFN_cuStreamDestroy_v4000)
HOOK_ADDR(cuMemGetAddressRange_v2, PFN_cuMemGetAddressRange_v3020)
HOOK_ADDR(cuPointerGetAttribute, PFN_cuPointerGetAttribute_v4000)
HOOK_ADDR(cuPointerGetAttributes, PFN_cuPointerGetAttributes_v7000)
HOOK_ADDR(cuIpcGetMemHandle, PFN_cuIpcGetMemHandle_v4010)
HOOK_ADDR(cuCtxEnablePeerAccess, PFN_cuCtxEnablePeerAccess_v4000)
HOOK_ADDR(cuStreamBeginCapture_v2, PFN_cuStreamBeginCapture_v10010)
HOOK_ADDR(cuStreamBeginCapture_v2_ptsz, PFN_cuStreamBeginCapture_v10010_ptsz)
HOOK_ADDR(cuStreamEndCapture, PFN_cuStreamEndCapture_v10000)
HOOK_ADDR(cuStreamEndCapture_ptsz, PFN_cuStreamEndCapture_v10000_ptsz)
HOOK_ADDR(cuStreamBeginCapture, PFN_cuStreamBeginCapture_v10000)
HOOK_ADDR(cuStreamBeginCapture_ptsz, PFN_cuStreamBeginCapture_v10000_ptsz)
#if MSH_HAVE_TO_GRAPH
HOOK_ADDR(cuStreamBeginCaptureToGraph, PFN_cuStreamBeginCaptureToGraph_v12030)
HOOK_ADDR(cuStreamBeginCaptureToGraph_ptsz, PFN_cuStreamBeginCaptureToGraph_v12030_ptsz)
#else
void *const msh_hk_cuStreamBeginCaptureToGraph = NULL, *const msh_hk_cuStreamBeginCaptureToGraph_ptsz = NULL;
#endif
