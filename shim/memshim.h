/*
 * memshim.h: the public C interface of libmemshim.so.
 *
 * These are the only non-CUDA symbols the library exports. They are what PyTorch's
 * CUDAPluggableAllocator calls (memshim_malloc / memshim_free and the optional hooks) and what a
 * program may call to mark epochs or return cached memory. Every function is safe to call from
 * any thread and never aborts the caller: on failure it returns NULL / a non-zero errno value and
 * logs why. Nothing here may be called from inside a CUDA stream callback.
 */
#ifndef MEMSHIM_H
#define MEMSHIM_H

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MEMSHIM_VERSION "0.1.0"

/* A CUDA stream as an opaque pointer (cudaStream_t / CUstream), so this header needs no CUDA. */
typedef void *memshim_stream_t;

/* PyTorch pluggable-allocator entry points (torch.cuda.memory.CUDAPluggableAllocator). The
 * returned pointer is aligned to at least 512 bytes. NULL means out of memory; the diagnosis is
 * in the log and in the next report. */
void *memshim_malloc(ssize_t size, int device, memshim_stream_t stream);
void memshim_free(void *ptr, ssize_t size, int device, memshim_stream_t stream);

/* Work on `stream` uses `ptr`: its memory is not reused before that work completes. */
void memshim_record_stream(void *ptr, memshim_stream_t stream);

/* Return every wholly free physical page of every pool to the driver (torch.cuda.empty_cache()). */
void memshim_empty_cache(void);

/* Epoch and step boundaries: close the current epoch (a report is written when reports are on);
 * count an optimizer step (MEMSHIM_EPOCH=steps closes an epoch every MEMSHIM_EPOCH_STEPS). */
void memshim_epoch(void);
void memshim_step(void);

/* The GC step of the OOM rescue chain (DESIGN.md 4) and of MEMSHIM_GC=epoch|threshold calls this
 * instead of memshim's own gc.collect(), under the same rules: only from memshim_malloc (tensor
 * mode) or an epoch boundary (memshim_epoch, memshim_step), never inside the cudaMalloc hook
 * (PyTorch's caching allocator may be mid-call there), and in a CPython process only on a thread
 * that holds the GIL (call memshim through ctypes.PyDLL). So pointing it at gc.collect() is safe.
 * It returns the number of bytes it believes it released (or 0). */
typedef size_t (*memshim_gc_fn)(void *arg);
void memshim_set_gc_callback(memshim_gc_fn fn, void *arg);

/* Counters of the pool that serves `device`, for tests and the Python side. Returns 0 and fills
 * `out`, or ENODEV when that device has no pool yet. */
struct memshim_stats {
    size_t live_bytes, peak_live_bytes;         /* requested bytes of live blocks */
    size_t reserved_bytes, peak_reserved_bytes; /* physical bytes mapped by the pool */
    size_t map_ops, unmap_ops, reclaimed_pages;
    size_t allocs, frees, ooms;
};
int memshim_get_stats(int device, struct memshim_stats *out);

#ifdef __cplusplus
}
#endif
#endif
