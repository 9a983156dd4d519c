/*
 * device.h: the small device interface the pool is written against (DESIGN.md 4).
 *
 * Three backends implement it: the real CUDA driver (policy/dev_cuda.c, also used with the driver
 * test double through LD_LIBRARY_PATH), and the simulated device (policy/dev_sim.c) that only
 * counts, for fast replay. Handles, addresses, streams and events are opaque 64-bit values.
 * Every call returns 0 or an errno value (msh.h); ENOMEM from create() means "no physical memory
 * left", which the pool treats as pressure, not as an error. A backend never calls back into
 * the pool and never takes a pool lock.
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
    int (*create)(struct msh_device *d, size_t size, uint64_t *handle);
    int (*release)(struct msh_device *d, uint64_t handle);
    /* map `handle` (of exactly `size` bytes) at `va` and grant read/write access to the device */
    int (*map)(struct msh_device *d, uint64_t va, size_t size, uint64_t handle);
    int (*unmap)(struct msh_device *d, uint64_t va, size_t size);
    /* record an event on `stream`; *event is later queried and released */
    int (*event_record)(struct msh_device *d, uint64_t stream, uint64_t *event);
    /* 0: every work item before the event has completed; EBUSY: not yet; other: error */
    int (*event_query)(struct msh_device *d, uint64_t event);
    int (*event_release)(struct msh_device *d, uint64_t event);
    /* make `stream` wait for `event` (no host blocking) */
    int (*stream_wait)(struct msh_device *d, uint64_t stream, uint64_t event);
    /* block until all work on the device has completed */
    int (*synchronize)(struct msh_device *d);
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

/* The real driver (or the double), resolved through msh_cuda (shim/real.c). Requires a current
 * context for `ordinal` when called. */
int msh_dev_cuda_init(struct msh_device *d, int ordinal);

#endif
