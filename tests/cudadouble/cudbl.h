/*
 * cudbl.h: the test-only extension API of the CUDA driver double (build/double/libcuda.so.1).
 *
 * These functions exist only in the double, never in a real libcuda: a test that calls them must
 * link against (or dlsym from) the double. They let a test play the GPU (run queued work when it
 * chooses), inject failures, and check that nothing leaked. All are thread-safe. See
 * docs/test-double.md for the environment variables that do the same without code.
 */
#ifndef CUDBL_H
#define CUDBL_H

#include <cuda.h>
#include <cudaTypedefs.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABIs newer than the headers the double may be built with (CUDA 12.5 and later): their
 * declarations and cudaTypedefs.h typedefs, as CUDA 13.2's headers write them, so that every row of
 * the double's cuGetProcAddress table is checked against a PFN type and tests can hold what a
 * lookup returns in its type. Built against headers that have them, the headers' own are used
 * (tests/cudadouble/test_abi.py also compiles the double against the newest cudaTypedefs.h on the
 * machine and compares these with it). */
#if CUDA_VERSION < 13000
CUresult CUDAAPI cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx);
CUresult CUDAAPI cuCtxSynchronize_v2(CUcontext ctx);
typedef CUresult (CUDAAPI *PFN_cuCtxGetDevice_v13000)(CUdevice *device, CUcontext ctx);
typedef CUresult (CUDAAPI *PFN_cuCtxSynchronize_v13000)(CUcontext ctx);
#endif
#if CUDA_VERSION < 13010
CUresult CUDAAPI cuLaunchHostFunc_v2(CUstream hStream, CUhostFn fn, void *userData, unsigned int syncMode);
typedef CUresult (CUDAAPI *PFN_cuLaunchHostFunc_v13010)(CUstream hStream, CUhostFn fn, void *userData, unsigned int syncMode);
typedef CUresult (CUDAAPI *PFN_cuLaunchHostFunc_v13010_ptsz)(CUstream hStream, CUhostFn fn, void *userData, unsigned int syncMode);
#endif

/* Live objects of the double. handles: physical allocations still holding memory (a released
 * handle that is still mapped counts until its last unmap); mappings: cuMemMap ranges;
 * reservations: cuMemAddressReserve ranges; allocs: cuMemAlloc/cuMemAllocAsync blocks not yet
 * freed (a cuMemFreeAsync still queued counts); events, streams: created and not destroyed
 * (internal default streams are not counted); bytes_in_use: device bytes charged on all devices;
 * misuse: undefined behaviour seen so far (only when misuse is counted, see below). */
struct cudbl_counts {
    long handles, mappings, reservations, allocs, events, streams;
    size_t bytes_in_use;
    long misuse;
    long host_handles;        /* of `handles`: host-located (cuMemCreate with a HOST or HOST_NUMA location) */
    size_t host_bytes_in_use; /* their bytes, charged to the host (CUDBL_HOST_CAPACITY), never to a device */
};
void cudbl_get_counts(struct cudbl_counts *out);
/* The most device bytes charged to `device` at any moment since the process started
 * (cuMemCreate and cuMemAlloc; host-located handles never count), and the same for the host's. */
size_t cudbl_device_peak(int device);
size_t cudbl_host_peak(void);
/* The same peak over a window: the most device bytes charged to `device` since the last call with
 * new_window = 1 (or since the start), and in *used_now (may be NULL) the bytes charged now. With
 * new_window = 1 the figures are read first, then the window restarts at the current charge. A
 * test brackets a request with two calls: the second's peak minus the first's *used_now is how far
 * the device's free memory (what another process would get) fell while it was served or refused. */
size_t cudbl_device_mark_peak(int device, int new_window, size_t *used_now);
/* Host memory through VMM, as CUDBL_HOST_VMM and CUDBL_HOST_CAPACITY set it: `vmm` is a mask of
 * CUDBL_HOST_VMM_NUMA (CU_MEM_LOCATION_TYPE_HOST_NUMA) and CUDBL_HOST_VMM_HOST
 * (CU_MEM_LOCATION_TYPE_HOST), -1 to keep; `capacity` 0 keeps it. Refused while host handles live. */
#define CUDBL_HOST_VMM_NUMA 1
#define CUDBL_HOST_VMM_HOST 2
int cudbl_set_host(int vmm, size_t capacity);

/* Bytes of the VMM API, for tests that hold an allocator's own figures against the driver's
 * (tests/reports: reserved bytes and their peaks in memshim's reports). handle_bytes: physical
 * memory of cuMemCreate handles not yet freed (a released handle still mapped counts until its
 * last unmap, as in the driver); mapped_bytes: bytes covered by cuMemMap ranges;
 * reserved_va_bytes: bytes of cuMemAddressReserve ranges. *_peak: the most since the process
 * started; *_mark_peak: the most since the last call with new_window = 1 (or since the start).
 * With new_window = 1 the figures are read first, then the window restarts at the current ones.
 * Totals over all devices. */
struct cudbl_bytes {
    size_t handle_bytes, handle_peak, handle_mark_peak;
    size_t mapped_bytes, mapped_peak, mapped_mark_peak;
    size_t reserved_va_bytes;
    size_t unmapped_total, released_total; /* cumulative: bytes cuMemUnmap took away, bytes of
                                            * handles whose memory went back (cuMemRelease) */
};
void cudbl_get_bytes(struct cudbl_bytes *out, int new_window);
/* Calls fn once for every mapping now held (each is one whole handle: the double maps handles
 * whole), in no particular order, under the double's lock (fn must not call the double).
 * Returns the number of mappings. */
long cudbl_foreach_mapping(void (*fn)(void *arg, CUdeviceptr va, size_t size), void *arg);

/* Misuse is what a real driver leaves undefined: a destroyed stream, event or graph handle used
 * again, a device touching memory it has no access to (VMM access is per device), a kernel
 * touching another device's cuMemAlloc memory without peer access. The double prints
 * "cudbl: MISUSE in <function>: <what>" and aborts, so the test fails. With on = 0 (or env
 * CUDBL_MISUSE=count) it counts the misuse in cudbl_counts.misuse instead, and the call fails
 * (CUDA_ERROR_INVALID_HANDLE, or CUDA_ERROR_ILLEGAL_ADDRESS for a bad access; queued work that
 * faults does not run). */
void cudbl_set_misuse_abort(int on);

/* The double's cuGetProcAddress table, row by row (tests/cudadouble/test_abi.py): the base name,
 * the CUDA version its ABI appeared in (cudaTypedefs.h's PFN_<name>_v<version>) and whether it is
 * the per-thread default stream form (_ptsz/_ptds). Returns 0 past the last row. */
int cudbl_proc_row(int i, const char **name, int *version, int *per_thread);

/* An emulated kernel: like cudbl_stream_enqueue, but it touches [p, p + n) (writes when write is
 * non-zero) from the device of stream s, whose context must be current (as for a launch). When
 * it runs, the double checks that the device may: a violation is misuse and fn does not run. */
int cudbl_launch(CUstream s, CUdeviceptr p, size_t n, int write, void (*fn)(void *), void *arg);
/* Whether `device` may touch [p, p + n) directly now, as a kernel would (no staged copy, no
 * peer access enabled): CUDA_SUCCESS or CUDA_ERROR_ILLEGAL_ADDRESS, by the rules in
 * docs/test-double.md; counts nothing. */
int cudbl_check_access(int device, CUdeviceptr p, size_t n, int write);
/* Access grants (issue 15): how many times cuMemSetAccess gave `device` read or write access to a
 * mapping, since the process started (one per mapping and device named); and how many mappings
 * `device` may access now. -1 for an invalid device. */
long cudbl_access_grants(int device);
long cudbl_mappings_accessible(int device);
/* Peer capability between devices a and b (both ways), as cuDeviceCanAccessPeer reports it;
 * overrides CUDBL_PEER. */
int cudbl_set_peer(int a, int b, int can);

/* Enqueue fn(arg) on stream s (0, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD mean the current
 * context's default streams): an emulated kernel. It runs later, in stream order, on the thread
 * that synchronizes, in cudbl_progress, or on the background "GPU" thread in async mode. fn must
 * not call the CUDA API. Returns CUDA_SUCCESS or the CUresult of the failure. */
int cudbl_stream_enqueue(CUstream s, void (*fn)(void *), void *arg);
/* Run up to max_items queued items that are ready (any stream, round robin); returns how many
 * ran. Items whose cross-stream waits are not yet satisfied are skipped. */
int cudbl_progress(int max_items);
/* Items queued on s and not yet complete (0 when idle, -1 for an invalid stream). */
long cudbl_stream_pending(CUstream s);
/* Async mode on/off: a background thread runs ready items after a small random delay
 * (up to CUDBL_ASYNC_DELAY_US microseconds, default 200). Same as env CUDBL_ASYNC=1. */
void cudbl_set_async(int on);

/* Fault injection. name is a base name ("cuMemCreate"; "cuMemAlloc_v2" works too). cudbl_fail_nth
 * fails the n-th call counted from now (n = 1: the next call) with err; err = CUDA_SUCCESS picks
 * the default (CUDA_ERROR_OUT_OF_MEMORY for cuMemCreate, cuMemAlloc, cuMemAllocAsync and
 * cuMemAddressReserve, CUDA_ERROR_UNKNOWN otherwise). cudbl_fail_prob fails each call with
 * probability p drawn from a PRNG seeded with seed (same seed, same calls fail). A failed call has
 * no side effect. cudbl_fail_clear removes every rule, including those from the environment. */
void cudbl_fail_nth(const char *name, long n, CUresult err);
void cudbl_fail_prob(const char *name, double p, unsigned long long seed, CUresult err);
void cudbl_fail_clear(void);
/* Calls of the named function since the process started (failed and injected calls included);
 * -1 for a name the double does not know. */
long cudbl_call_count(const char *name);
/* The calling thread's context stack depth (cuCtxPushCurrent adds one, cuCtxPopCurrent takes one;
 * cuCtxSetCurrent replaces the top, or makes a stack of one): what a caller's state includes. */
int cudbl_ctx_depth(void);
/* Bytes the calls of the named VMM function covered since the process started, counted like
 * cudbl_call_count (refused calls included): the size argument of cuMemCreate, cuMemMap,
 * cuMemUnmap, cuMemSetAccess, cuMemAddressReserve and cuMemAddressFree, and the released handle's
 * size for cuMemRelease (0 for an unknown handle). 0 for other functions, -1 for an unknown name. */
long long cudbl_call_bytes(const char *name);

/* Reconfigure the emulated machine: devices (1..16), capacity per device in bytes, VMM
 * granularity (a power of two, at least the page size). 0 keeps a value. Allowed only while no
 * memory is held (no handles, allocations or reservations); otherwise CUDA_ERROR_NOT_PERMITTED.
 * Called before cuInit, it overrides CUDBL_DEVICES/CUDBL_CAPACITY/CUDBL_GRANULARITY. */
int cudbl_configure(int devices, size_t capacity, size_t granularity);

#ifdef __cplusplus
}
#endif

#endif
