/*
 * torch.h: what shim/torch.c (PyTorch's pluggable-allocator entry points, CUDA-graph capture
 * pools, PyTorch-named statistics, the Python start-up hook) offers the rest of the library.
 * The exported entry points themselves are declared in memshim.h. Nothing here calls a CUDA hook.
 */
#ifndef MSH_TORCH_H
#define MSH_TORCH_H

#include <stddef.h>
#include <stdint.h>

#include "pool.h"

/* Called by core.c just before it creates device's main pool: puts the device's shared limit
 * (struct msh_pool_share: MEMSHIM_LIMIT, or a smaller one from set_per_process_memory_fraction)
 * into prm, so capture pools created later count against the same limit. `total` is the
 * device's memory. */
void msh_torch_pool_params(int device, size_t total, struct msh_pool_params *prm);

/* The limit in force for device (0 = none): MEMSHIM_LIMIT or PyTorch's memory fraction. */
size_t msh_torch_limit(int device);

/* PyTorch's own memory_stats() figures handed over by the Python side for the next report
 * (segment mode, docs/pytorch.md): entry i of device: 1 with its key and value when it exists, else 0. */
int msh_torch_report_stat(int device, int i, const char **key, int64_t *val);

/* The installed PyTorch's version as the Python side reported it (memshim_torch_set_version),
 * for the reports' versions.torch; NULL when unknown (not a PyTorch process, or before import). */
const char *msh_torch_version(void);

/* Tests: replace the query "is this stream capturing a CUDA graph" (default: the driver's
 * cuStreamIsCapturing when it has one; NULL restores the default). The query returns 1 when
 * capturing, 0 when not, -1 when it cannot tell. */
void msh_torch_set_capture_query(int (*fn)(void *stream));

/* The last capture of device ended (capture.c): destroy the capture pools whose uses were all
 * released and whose blocks were freed meanwhile, and let every capture pool of the device run
 * what it deferred. Never called with a pool lock held. */
void msh_torch_capture_settle(int device);

/* Tests and reports: capture-pool groups destroyed so far, destroys a capture deferred, groups
 * alive now. */
void msh_torch_capture_counts(uint64_t *destroyed, uint64_t *deferred, int *alive);
/* A peer was granted access to device's memory: the capture pools re-grant their mapped pages. */
void msh_torch_regrant_access(int device);

/* Tests: how many times the capture pools' lock was taken so far. */
uint64_t msh_torch_capture_lock_takes(void);

#endif
