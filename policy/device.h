/*
 * device.h: the small device interface the pool is written against (DESIGN.md 4).
 *
 * Three backends implement it: the real CUDA driver (policy/dev_cuda.c, also used with the driver
 * test double through LD_LIBRARY_PATH), and the simulated device (policy/dev_sim.c) that only
 * counts, for fast replay. Handles, addresses, streams and events are opaque 64-bit values.
 * Every call returns 0 or an errno value (msh.h); ENOMEM from create() means "no physical memory
 * left", which the pool treats as pressure, not as an error. A backend never calls back into
 * the pool and never takes a pool lock. The pool never holds its own lock while it calls a
 * backend (a slow driver call must not stall other threads), so calls come from several threads
 * at once: a backend must be thread-safe.
 */
#ifndef MSH_DEVICE_H
#define MSH_DEVICE_H

#include <stddef.h>
#include <stdint.h>

struct msh_device;

struct msh_device_ops {
    const char *name;
    int (*mem_info)(struct msh_device *d, size_t *free_bytes, size_t *total_bytes);
    int (*granularity)(struct msh_device *d, size_t *gran);
    int (*reserve)(struct msh_device *d, size_t size, size_t align, uint64_t *va);
    int (*unreserve)(struct msh_device *d, uint64_t va, size_t size);
    /* a physical allocation of `size` bytes (a multiple of the granularity) */
    int (*create)(struct msh_device *d, size_t size, uint64_t *handle);
    /* give back a handle that is no longer mapped; `size` is what create() was asked for */
    int (*release)(struct msh_device *d, uint64_t handle, size_t size);
    /* map `handle` (of exactly `size` bytes) at `va`; the range is unusable until set_access */
    int (*map)(struct msh_device *d, uint64_t va, size_t size, uint64_t handle);
    /* grant the device read/write access to [va, va + size), which may span several mappings
     * (one call per contiguous run is enough; every byte of the range must be mapped) */
    int (*set_access)(struct msh_device *d, uint64_t va, size_t size);
    /* unmap [va, va + size): whole mappings only (the range may span several) */
    int (*unmap)(struct msh_device *d, uint64_t va, size_t size);
    /* events are created once and recorded many times (the pool keeps them in a free list) */
    int (*event_create)(struct msh_device *d, uint64_t *event);
    /* record `event` on `stream`: it completes when the work enqueued on it so far has */
    int (*event_record)(struct msh_device *d, uint64_t event, uint64_t stream);
    /* 0: every work item before the event has completed; EBUSY: not yet; other: error */
    int (*event_query)(struct msh_device *d, uint64_t event);
    int (*event_release)(struct msh_device *d, uint64_t event);
    /* make `stream` wait for `event` as last recorded (no host blocking) */
    int (*stream_wait)(struct msh_device *d, uint64_t stream, uint64_t event);
    /* block until all work on the device has completed */
    int (*synchronize)(struct msh_device *d);
    /* Optional (NULL: everything belongs to the device's own context, as in the simulation).
     * stream_home: the context `stream` belongs to, 0 for the device's own (an event recorded on
     * a stream must come from that stream's context); may call the driver, never under a lock.
     * event_create_on: an event of context `home` (a stream_home value other than 0).
     * stream_sync: block until the work queued on `stream` so far has completed.
     * add_access: from now on grant `peer_device` access too (set_access includes it): 0 when
     * added, EEXIST when it already was, another errno when the peer cannot reach this device. */
    int (*stream_home)(struct msh_device *d, uint64_t stream, uint64_t *home);
    int (*event_create_on)(struct msh_device *d, uint64_t home, uint64_t *event);
    int (*stream_sync)(struct msh_device *d, uint64_t stream);
    int (*add_access)(struct msh_device *d, int peer_device);
    /* Optional, for spilling to host memory (docs/pool.md "Spill"; NULL: the backend has none).
     * host_create: physical memory of `size` bytes on the host, mappable into the device's address
     * space like a handle of create() (map, set_access, unmap and release take it): ENOTSUP when
     * the driver has no host memory through VMM, ENOMEM when the host has no more.
     * copy: copy `size` bytes between two mapped ranges of this device's address space, complete
     * when it returns (no stream of the program's sees it). */
    int (*host_create)(struct msh_device *d, size_t size, uint64_t *handle);
    int (*copy)(struct msh_device *d, uint64_t dst, uint64_t src, size_t size);
};

struct msh_device {
    const struct msh_device_ops *ops;
    int ordinal; /* CUDA device ordinal */
    void *impl;  /* backend state */
};

/* The simulated device: `capacity` bytes of physical memory (0 = unlimited), granularity `gran`.
 * Events complete at once; nothing touches host memory. */
int msh_dev_sim_init(struct msh_device *d, size_t capacity, size_t gran);
void msh_dev_sim_fini(struct msh_device *d);
/* The simulated device gets host memory through VMM (host_create), `host_capacity` bytes (0:
 * unlimited); without this call host_create answers ENOTSUP, as a driver without it. */
void msh_dev_sim_host(struct msh_device *d, size_t host_capacity);
size_t msh_dev_sim_host_used(struct msh_device *d);

/* The real driver (or the double), resolved through msh_cuda (shim/real.c). Requires a current
 * context for `ordinal` when called. */
int msh_dev_cuda_init(struct msh_device *d, int ordinal);
/* Give back what msh_dev_cuda_init took (its primary-context reference, its state); every pool on
 * the device must be destroyed first. */
void msh_dev_cuda_fini(struct msh_device *d);

#endif
