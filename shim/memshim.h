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

/* The figures of `device`'s last closed epoch (what its epoch report says), for the frameworks'
 * loggers (hooks/python/memshim/_frameworks.py). 0, ENODEV (no pool there), ENOENT (no epoch
 * closed yet), EINVAL. */
struct memshim_epoch_figures {
    unsigned long long epoch, steps;
    unsigned long long allocated_bytes;      /* at the epoch's end */
    unsigned long long allocated_peak_bytes, reserved_peak_bytes;
    double fragmentation;                    /* 1 - largest free extent / free bytes */
    double peak_allocated_over_peak_reserved;
    unsigned long long ooms, oom_rescues;    /* since the start (cumulative, as in the report) */
    long long growth_bytes;                  /* allocated bytes at this epoch's end minus the last's */
};
int memshim_last_epoch(int device, struct memshim_epoch_figures *out);

/* The run is ending after signal `signo` without memshim's exit handler (Python after an
 * uncaught KeyboardInterrupt: it finalizes, then kills itself with SIGINT): write the epoch in
 * progress (reason `interrupted`), the summary and the snapshot now. 0, ENODEV (memshim has not
 * started), EINVAL. */
int memshim_run_interrupted(int signo);

/* PyTorch memory snapshots served by memshim (shim/record/history.c; the Python side is
 * hooks/python/memshim/_history.py). memshim_history_record: mode 0 stops recording, 1 keeps
 * the sites of live blocks only ("state"), 2 records every event too ("all") in a ring of
 * `max_entries` (at most 2^24); `clear` drops the events so far; `frames` 0 records no stacks.
 * memshim_snapshot: the snapshot as pickle bytes (protocol 4) in *buf (release them with
 * memshim_snapshot_free). memshim_snapshot_dump: write them to `path` (temp file + rename, mode
 * 0600). Each returns 0 or an errno value. */
int memshim_history_record(int mode, long long max_entries, int clear, int frames);
int memshim_snapshot(unsigned char **buf, size_t *len);
void memshim_snapshot_free(unsigned char *buf);
int memshim_snapshot_dump(const char *path);
/* Frames whose file starts with `prefix` are library frames, never an allocation site (the
 * torch package directory, memshim's own Python package). 0, EINVAL or ENOSPC (8 at most). */
int memshim_sites_library_path(const char *prefix);

/* ---- PyTorch (docs/pytorch.md) ---------------------------------------------------------------
 * What the Python start-up hook (hooks/python/memshim) wires to torch._C._CUDAPluggableAllocator
 * and calls for PyTorch's memory API. The alloc/free entry points PyTorch calls are in the C++
 * glue (libmemshim_torch.so: memshim_glue_malloc/_free), which calls these and turns a NULL
 * into c10::OutOfMemoryError. Capture pools: memory allocated between begin and end of a
 * CUDA-graph capture pool is handed out again only inside that pool, until release_pool and the
 * last of its blocks is freed. */
/* Tensor allocation on the device's main pool, or, when `stream` is capturing a graph (the
 * backstop for allocations no begin_allocate_to_pool filter claimed), in that capture's pool.
 * NULL: out of memory (see memshim_torch_oom_message). */
void *memshim_torch_alloc(ssize_t size, int device, memshim_stream_t stream);
/* Tensor allocation in capture pool (id0, id1) of device (begun with begin_allocate_to_pool). */
void *memshim_torch_alloc_in_pool(ssize_t size, int device, memshim_stream_t stream,
                                  unsigned long long id0, unsigned long long id1);
/* Free a tensor's block (main pool or capture pool); size is the size PyTorch allocated. */
void memshim_torch_free(void *ptr, ssize_t size, int device, memshim_stream_t stream);
void memshim_torch_record_stream(void *ptr, memshim_stream_t stream);
/* set_init_fn: PyTorch's lazy CUDA initialization. */
void memshim_torch_init(int device_count);
/* set_memory_fraction_fn: the device's limit becomes fraction x its memory (the smaller of that
 * and MEMSHIM_LIMIT). get: the fraction in force (1.0 without a limit). */
void memshim_torch_set_memory_fraction(double fraction, int device);
double memshim_torch_get_memory_fraction(int device);
/* per_process_memory_fraction from PyTorch's allocator settings (PYTORCH_ALLOC_CONF,
 * PYTORCH_CUDA_ALLOC_CONF): the fraction of every device whose fraction is not set yet. 0, or
 * EINVAL outside (0, 1]. */
int memshim_torch_conf_memory_fraction(double fraction);
/* set_base_alloc_fn: the block that contains ptr and its size (ptr itself, *size untouched when
 * memshim did not allocate it). */
void *memshim_torch_base_alloc(void *ptr, size_t *size);
/* set_begin_allocate_to_pool / set_end_allocate_to_pool_fn / set_release_pool, MempoolId_t as
 * its two halves. `filter` is PyTorch's std::function<bool(cudaStream_t)> (x86-64: a pointer to
 * it); C cannot call it: the glue evaluates it and passes NULL here. As in PyTorch's own
 * allocator, each begin (and each retain: createOrIncrefPool in newer PyTorch) adds one use of
 * the pool, each release takes one away, and the pool's memory goes only when no use is left and
 * its last block is freed; a begin with the id of a pool that still exists joins it. While any
 * capture of the device is open (begin..end), nothing memshim does synchronizes the device or
 * unmaps: that work waits for the last end. pool_uses: the use count now (0 for an unknown id). */
void memshim_torch_begin_allocate_to_pool(int device, unsigned long long id0,
                                          unsigned long long id1, void *filter);
void memshim_torch_end_allocate_to_pool(int device, unsigned long long id0, unsigned long long id1);
void memshim_torch_release_pool(int device, unsigned long long id0, unsigned long long id1);
void memshim_torch_retain_pool(int device, unsigned long long id0, unsigned long long id1);
int memshim_torch_pool_uses(int device, unsigned long long id0, unsigned long long id1);
/* PyTorch-named statistics of device (torch.cuda.memory_stats() keys, flat: "allocated_bytes.all.
 * current", ...): fills vals[0..n) in the order of memshim_torch_stat_name(i) and returns how
 * many exist (call with n = 0 to count). Peaks reset with memshim_torch_reset_peak, cumulative
 * figures with memshim_torch_reset_accumulated (device -1: every device). */
int memshim_torch_stats(int device, long long *vals, int n);
const char *memshim_torch_stat_name(int i);
void memshim_torch_reset_peak(int device);
void memshim_torch_reset_accumulated(int device);
/* The text after "CUDA out of memory. " for the last failed request of this thread: what was
 * asked, the device, and memshim's diagnosis. Returns the length written (NUL-terminated). */
int memshim_torch_oom_message(int device, size_t size, char *buf, size_t len);
/* Segment mode: PyTorch's own memory_stats() figures for the epoch being closed (the next
 * report carries them as torch_memory_stats); clear drops them all. */
void memshim_torch_epoch_stat(int device, const char *key, long long value);
void memshim_torch_epoch_stats_clear(void);
/* Close the current epoch with reason "manual", "dataloader", "hf_trainer" or "lightning"
 * (anything else: EINVAL). Only when memshim has started (never starts it): returns ENODEV
 * otherwise. */
int memshim_epoch_from(const char *reason);
/* memshim_step() when memshim has started; nothing (no driver call) otherwise. */
void memshim_step_if_started(void);
/* Settings and state for the Python side, without starting memshim unless `name` is
 * "enabled": "mode" (0 auto, 1 tensor, 2 segment, 3 off), "started", "enabled", "tensor",
 * "epoch_detect", "gc" and "empty_cache" (enum values of msh.h), "log". -1: unknown name. */
long memshim_torch_setting(const char *name);
/* The PyTorch version of this process (the reports' versions.torch). */
void memshim_torch_set_version(const char *version);
/* One line through memshim's logger (level 0 error .. 3 debug). */
void memshim_torch_log(int level, const char *msg);
/* Where this libmemshim.so was loaded from (absolute), or "" when unknown. */
const char *memshim_library_path(void);

#ifdef __cplusplus
}
#endif
#endif
